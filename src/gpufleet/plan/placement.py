"""Roles -> devices, predicted bytes per device, and whether the job fits: a `Plan` that checks itself.

    plan = make_plan(load_job("job.yaml"), parse_gpu_spec("3x16GB"), os.environ)
    plan.fits, plan.comfortable, plan.devices[0].total, find_fixes(...), largest_that_fits(...)

A plan is built from the resolved job, the hardware and the topology (`gpufleet.topology`): each
policy rank holds the policy (a full replica with DDP, a 1/N shard with FSDP), its rollout (KV cache),
its training activations, and every role that is colocated (the reference model when beta > 0, the
reward model when set); each dedicated scorer rank holds the roles placed on its device. Per process:

    total = weights + grads + optimizer + other + max(train, rollout, scoring, optimizer step)

because the phases of one RL step follow each other (sampling, then scoring, then forward/backward per
micro-batch, then the optimizer step) and each frees its working memory before the next. Two processes
on one device (a declared shared scorer) add up. `other` is the framework overhead per process, the
generation batch's tensors and, with FSDP, the all-gathered root module plus two layers (current and
prefetched) and one layer's unsharded gradient.

A plan *fits* when every device's total is at most its memory, and is *comfortable* with at least
`HEADROOM` (10%) left on every device (allocator fragmentation, CUDA graphs, kernels' workspaces).

Choices. `placement.reference` / `placement.reward` set to `auto` are the planner's: colocated when
that is comfortable (no extra process, no transfer, scoring runs in parallel on every policy rank),
otherwise a dedicated scorer on a device no policy rank uses, otherwise on the last policy device
(`auto` policy only). Explicit values (colocate, device ids, strategy, checkpointing, micro-batch) are
checked, never changed: when they do not fit, `find_fixes` proposes changes, each verified by planning
it again, cheapest first: a smaller micro-batch, gradient checkpointing, a dedicated scorer device,
FSDP over the same GPUs, FSDP over more GPUs, fewer tokens.

No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.config.load import Resolved
from gpufleet.config.problems import Problem, Source
from gpufleet.errors import UserError
from gpufleet.hardware import GiB, Hardware, parse_gpu_spec
from gpufleet.plan.memory import (
    OVERHEAD_ENV,
    REWARD_MODEL_BATCH,
    Arch,
    ParamCount,
    Precision,
    UnsupportedModel,
    arch_from_config,
    count_parameters,
    fast_decode_copies,
    gib,
    logprob_scoring_bytes,
    overhead_bytes,
    reward_model_bytes,
    rollout_bytes,
    train_activations,
    train_state_bytes,
    training_precision,
)
from gpufleet.topology import Topology, resolve_topology

HEADROOM = 0.10
"""Fraction of every device's memory a comfortable plan leaves free."""

MAX_GPUS = 64
"""The most GPUs the "FSDP with more GPUs" fix considers."""

PHASES = ("train", "rollout", "scoring", "optimizer step")


class PlanError(ValueError):
    """A plan whose numbers do not add up (a bug in the planner, not in the job)."""


# ---------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A model the plan sizes: its path, where its config.json came from, its numbers."""

    path: str
    source: str
    arch: Arch
    params: ParamCount


@dataclass(frozen=True)
class Models:
    policy: ModelSpec
    reward: ModelSpec | None
    notes: tuple[str, ...] = ()
    """What could not be sized (e.g. a reward model whose config.json is not available)."""


def _spec(path: str, env: Mapping[str, str], head: str) -> ModelSpec | str:
    from gpufleet.plan.known_models import lookup_config

    found = lookup_config(path, env)
    if found is None:
        return "its config.json is not available offline (not a local folder, not in the Hugging Face cache, not a known model)"
    raw, source = found
    try:
        arch = arch_from_config(raw)
    except UnsupportedModel as e:
        return str(e)
    return ModelSpec(path, source, arch, count_parameters(arch, head))


def load_models(r: Resolved, env: Mapping[str, str]) -> Models:
    """The policy (and reward) model numbers. UserError naming model.path when the policy cannot be sized."""
    policy = _spec(r.job.model.path, env, "causal_lm")
    if isinstance(policy, str):
        raise UserError(
            f"model.path = {r.job.model.path} ({r.source('model.path')}): {policy}.",
            fix=f"download it once (huggingface-cli download {r.job.model.path}) or point model.path at a local "
            "folder with a config.json; gpufleet never downloads",
        )
    reward, notes = None, []
    if r.job.reward.model:
        got = _spec(r.job.reward.model, env, "classifier")
        if isinstance(got, str):
            notes.append(f"reward.model {r.job.reward.model}: {got}; its memory is not counted")
        else:
            reward = got
    return Models(policy, reward, tuple(notes))


# ------------------------------------------------------------------------------------------ loads


@dataclass
class ProcessLoad:
    """Predicted bytes of one process (a policy rank or a scorer rank)."""

    role: str
    weights: int
    grads: int
    optimizer: int
    other: int
    phases: dict[str, int]
    """Working memory of each phase; only the largest counts in `total`."""
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]) if self.phases else "-"

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.other + self.peak


@dataclass
class DeviceLoad:
    """One device (or the CPU's RAM) and the processes on it."""

    label: str
    """Device id as a string (`0`), or `cpu`."""
    index: int | None
    name: str
    capacity: int
    processes: list[ProcessLoad]

    @property
    def roles(self) -> list[str]:
        return [p.role for p in self.processes]

    def _sum(self, attr: str) -> int:
        return sum(getattr(p, attr) for p in self.processes)

    @property
    def weights(self) -> int:
        return self._sum("weights")

    @property
    def grads(self) -> int:
        return self._sum("grads")

    @property
    def optimizer(self) -> int:
        return self._sum("optimizer")

    @property
    def other(self) -> int:
        return self._sum("other")

    def phase(self, name: str) -> int:
        return sum(p.phases.get(name, 0) for p in self.processes)

    @property
    def total(self) -> int:
        return self._sum("total")

    @property
    def free(self) -> int:
        return self.capacity - self.total

    @property
    def headroom(self) -> float:
        """Fraction of the memory left free (1.0 when the memory is unknown: NVML could not say)."""
        return self.free / self.capacity if self.capacity else 1.0

    @property
    def fits(self) -> bool:
        return not self.capacity or self.total <= self.capacity

    @property
    def comfortable(self) -> bool:
        return self.headroom >= HEADROOM

    def summary(self) -> str:
        """`device 0: 9.41 / 16.00 GiB (41% free)`."""
        where = "cpu" if self.index is None else f"device {self.label}"
        if not self.capacity:
            return f"{where}: {gib(self.total)} GiB (memory unknown)"
        return f"{where}: {gib(self.total)} / {gib(self.capacity)} GiB ({self.headroom:.0%} free)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.label,
            "name": self.name,
            "roles": self.roles,
            "capacity_bytes": self.capacity,
            "total_bytes": self.total,
            "headroom": round(self.headroom, 4),
            "fits": self.fits,
            "components_bytes": {
                "weights": self.weights,
                "grads": self.grads,
                "optimizer": self.optimizer,
                "activations": self.phase("train"),
                "kv_cache": self.phase("rollout"),
                "scoring": self.phase("scoring"),
                "optimizer_step": self.phase("optimizer step"),
                "other": self.other,
            },
            "processes": [
                {
                    "role": p.role,
                    "total_bytes": p.total,
                    "peak_phase": p.peak_phase,
                    "weights": p.weights,
                    "grads": p.grads,
                    "optimizer": p.optimizer,
                    "other": p.other,
                    "phases": dict(p.phases),
                    "detail": dict(p.detail),
                }
                for p in self.processes
            ],
        }


# ------------------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """Where every role runs and what each device holds; `check()` runs on construction."""

    hardware: Hardware
    models: Models
    topo: Topology
    strategy: str
    """`single` (one policy rank), `ddp` or `fsdp`."""
    shards: int
    checkpointing: bool
    precision: Precision
    per_device_batch: int
    micro_batch: int
    rollout_rows: int
    prompt_tokens: int
    completion_tokens: int
    reference: str
    """`none`, `colocate` or `dedicated`."""
    reward_model: str
    """`none`, `colocate`, `dedicated` or `unsized` (its config is not available)."""
    devices: list[DeviceLoad]
    why: list[str] = field(default_factory=list)
    sets: list[str] = field(default_factory=list)
    """Flags that make the planner's own choices (auto placements) explicit."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Every invariant of a plan, all reported at once (PlanError names each factor)."""
        bad = []
        ranks = self.topo.policy_ranks
        if not self.topo.policy_devices:
            bad.append("no policy device")
        if self.strategy == "fsdp" and self.shards != ranks:
            bad.append(f"fsdp shards {self.shards} != policy ranks {ranks}")
        if self.strategy != "fsdp" and self.shards != 1:
            bad.append(f"{self.strategy} with shards {self.shards} (a replica per rank means 1)")
        if self.strategy == "single" and ranks != 1:
            bad.append(f"strategy single with {ranks} policy ranks")
        if not 1 <= self.micro_batch <= self.per_device_batch:
            bad.append(f"micro_batch {self.micro_batch} not in 1..per_device_batch {self.per_device_batch}")
        dedicated = self.topo.dedicated_roles()
        for role, where in (("reference", self.reference), ("reward", self.reward_model)):
            if where == "dedicated" and role not in dedicated:
                bad.append(f"{role} is dedicated but no scorer device holds it")
            if where in ("colocate", "none") and role in dedicated:
                bad.append(f"{role} is {where} but scorer device(s) hold it")
        if not self.hardware.is_cpu:
            n = len(self.hardware.devices)
            for d in self.devices:
                if d.index is None or not 0 <= d.index < n:
                    bad.append(f"device {d.label} does not exist (hardware has 0..{n - 1})")
        placed = [p.role for d in self.devices for p in d.processes if p.role.startswith("policy rank")]
        if len(placed) != len(self.topo.policy_devices):
            bad.append(f"{len(placed)} policy processes for {len(self.topo.policy_devices)} policy devices")
        for d in self.devices:
            for p in d.processes:
                if min(p.weights, p.grads, p.optimizer, p.other, *p.phases.values(), 0) < 0:
                    bad.append(f"negative bytes in {p.role} on {d.label}")
        if bad:
            raise PlanError("inconsistent plan: " + "; ".join(bad))

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def comfortable(self) -> bool:
        return all(d.comfortable for d in self.devices)

    @property
    def tightest(self) -> DeviceLoad:
        return min(self.devices, key=lambda d: d.headroom)

    def describe_strategy(self) -> str:
        parts = []
        if self.strategy == "single":
            parts.append("one policy rank (no data parallelism)")
        elif self.strategy == "ddp":
            parts.append(f"DDP over {self.topo.policy_ranks} policy ranks (a full replica each)")
        else:
            parts.append(f"FSDP2 over {self.topo.policy_ranks} policy ranks (shard degree {self.shards})")
        for role, where in (("reference", self.reference), ("reward model", self.reward_model)):
            if where == "colocate":
                parts.append(f"{role} colocated on every policy rank")
            elif where == "dedicated":
                dev = [str(d) for d, roles in self.topo.scorer_devices if role.split()[0] in roles]
                parts.append(f"{role} on dedicated scorer device {','.join(dev)}")
        parts.append("gradient checkpointing " + ("on" if self.checkpointing else "off"))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        pol = self.models.policy
        return {
            "hardware": self.hardware.describe(),
            "model": {
                "path": pol.path,
                "config_source": pol.source,
                "model_type": pol.arch.model_type,
                "parameters": pol.params.total,
            },
            "strategy": self.strategy,
            "shards": self.shards,
            "gradient_checkpointing": self.checkpointing,
            "precision": {"weights": self.precision.weights, "compute": self.precision.compute},
            "per_device_batch": self.per_device_batch,
            "micro_batch": self.micro_batch,
            "rollout_sequences_per_rank": self.rollout_rows,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reference": self.reference,
            "reward_model": self.reward_model,
            "fits": self.fits,
            "comfortable": self.comfortable,
            "headroom_required": HEADROOM,
            "devices": [d.to_dict() for d in self.devices],
            "why": list(self.why),
            "sets": list(self.sets),
            "notes": list(self.models.notes),
        }


def _used(r: Resolved) -> dict[str, bool]:
    return {"reference": r.job.algorithm.beta > 0, "reward": r.job.reward.model is not None}


def _build(r: Resolved, hw: Hardware, topo: Topology, models: Models, env: Mapping[str, str]) -> Plan:
    """The per-device loads of a job whose topology is valid (no choices made here)."""
    job = r.job
    t, ro = job.train, job.rollout
    pol = models.policy
    arch, params = pol.arch, pol.params
    precision = training_precision(job.model.dtype, t.precision)
    ranks = topo.policy_ranks
    strategy = "single" if ranks == 1 else job.placement.strategy
    shards = ranks if strategy == "fsdp" else 1
    pdb = t.per_device_batch
    micro = max(1, min(t.micro_batch or pdb, pdb))
    rows = pdb * t.steps_per_generation
    P, T = ro.max_prompt_length, ro.max_completion_length
    S = P + T
    gpu = not hw.is_cpu
    try:
        overhead = overhead_bytes(env, gpu=gpu)
    except ValueError as e:
        raise UserError(str(e), fix=f"unset {OVERHEAD_ENV} or give a size like 1.5GB") from None
    used = _used(r)
    dedicated = topo.dedicated_roles()
    ref_where = "none" if not used["reference"] else ("dedicated" if "reference" in dedicated else "colocate")
    if not used["reward"]:
        rm_where = "none"
    elif models.reward is None:
        rm_where = "unsized"
    else:
        rm_where = "dedicated" if "reward" in dedicated else "colocate"

    # The policy rank's parts.
    state = train_state_bytes(
        params, precision, shards=shards, ddp_buckets=strategy == "ddp", fused_adamw=strategy != "fsdp"
    )
    acts = train_activations(
        arch,
        params,
        precision,
        batch=micro,
        prompt_tokens=P,
        completion_tokens=T,
        checkpointing=job.model.gradient_checkpointing,
    )
    roll = rollout_bytes(
        arch,
        precision,
        sequences=rows,
        prompt_tokens=P,
        completion_tokens=T,
        weight_copies=fast_decode_copies(arch, precision, wrapped=strategy == "fsdp"),
    )
    ref_weights = params.total * precision.weight_bytes  # loaded like the policy (trainer.model_dtype)
    ref_scoring = logprob_scoring_bytes(
        arch, params, precision, batch=micro, prompt_tokens=P, completion_tokens=T, cached_weight_copies=False
    )
    old_scoring = (
        logprob_scoring_bytes(
            arch,
            params,
            precision,
            batch=micro,
            prompt_tokens=P,
            completion_tokens=T,
            cached_weight_copies=True,
        )
        if t.steps_per_generation * job.algorithm.num_iterations > 1
        else 0
    )
    if models.reward is not None:
        rm = models.reward
        rm_dtype = (
            rm.arch.checkpoint_dtype
            if rm.arch.checkpoint_dtype in ("float32", "bfloat16", "float16")
            else "float32"
        )
        rm_prec = Precision(rm_dtype, rm_dtype)
        rm_weights = rm.params.total * rm_prec.weight_bytes
        rm_work = reward_model_bytes(rm.arch, rm_prec, batch=min(REWARD_MODEL_BATCH, rows), tokens=S)
    else:
        rm_weights = rm_work = 0
    batch_tensors = rows * S * 8 * 4 + rows * T * 4 * 4
    gather = 0
    if strategy == "fsdp":  # root unit stays gathered fwd->bwd; current + prefetched layer; one layer's grads
        gather = (params.root + 2 * params.per_layer) * precision.weight_bytes
        gather += params.per_layer * precision.weight_bytes

    def policy_process(i: int, dev: int) -> ProcessLoad:
        weights = state["weights"]
        detail = {
            "policy_weights": state["weights"],
            "grads": state["grads"],
            "ddp_buckets": state["ddp_buckets"],
            "adamw_states": state["optimizer"],
            "saved_activations": acts.saved,
            "autocast_weight_copies": acts.weight_copies + acts.head_weight_copy,
            "logits": acts.logits,
            "backward_working_set": acts.backward,
            "kv_cache": roll["kv_cache"],
            "prefill": roll["prefill"],
            "sampling": roll["sampling"],
            "decoder_weight_copies": roll["decoder_weight_copies"],
            "overhead": overhead,
            "batch_tensors": batch_tensors,
            "fsdp_gathered": gather,
        }
        scoring = old_scoring
        role = f"policy rank {i}"
        if ref_where == "colocate":
            weights += ref_weights
            detail["reference_weights"] = ref_weights
            scoring = max(scoring, ref_scoring)
            role += " + reference"
        if rm_where == "colocate":
            weights += rm_weights
            detail["reward_model_weights"] = rm_weights
            scoring = max(scoring, rm_work)
            role += " + reward model"
        phases = {
            "train": acts.peak,
            "rollout": roll["peak"],
            "scoring": scoring,
            "optimizer step": state["optimizer_step"] if gpu else 0,
        }
        return ProcessLoad(
            role=role,
            weights=weights,
            grads=state["grads"] + state["ddp_buckets"],
            optimizer=state["optimizer"],
            other=overhead + batch_tensors + gather,
            phases=phases,
            detail=detail,
        )

    def scorer_process(dev: int, roles: tuple[str, ...]) -> ProcessLoad:
        weights, work, names, detail = 0, 0, [], {"overhead": overhead}
        if "reference" in roles and used["reference"]:
            weights += ref_weights
            work = max(work, ref_scoring)
            names.append("reference")
            detail["reference_weights"] = ref_weights
        if "reward" in roles and used["reward"]:
            weights += rm_weights
            work = max(work, rm_work)
            names.append("reward model")
            detail["reward_model_weights"] = rm_weights
        received = ranks * batch_tensors // max(topo.nnodes, 1)
        detail["received_batches"] = received
        return ProcessLoad(
            role="scorer: " + " + ".join(names),
            weights=weights,
            grads=0,
            optimizer=0,
            other=overhead + received,
            phases={"scoring": work},
            detail=detail,
        )

    per_device: dict[int, list[ProcessLoad]] = {}
    for i, dev in enumerate(topo.policy_devices):
        per_device.setdefault(dev, []).append(policy_process(i, dev))
    for dev, roles in topo.scorer_devices:
        per_device.setdefault(dev, []).append(scorer_process(dev, roles))

    if hw.is_cpu:
        procs = [p for dev in sorted(per_device) for p in per_device[dev]]
        devices = [DeviceLoad("cpu", None, "CPU RAM", hw.ram_bytes, procs)]
    else:
        devices = []
        for dev in sorted(per_device):
            d = hw.devices[dev] if 0 <= dev < len(hw.devices) else None
            devices.append(
                DeviceLoad(str(dev), dev, d.name if d else "?", d.total_bytes if d else 0, per_device[dev])
            )
    return Plan(
        hardware=hw,
        models=models,
        topo=topo,
        strategy=strategy,
        shards=shards,
        checkpointing=job.model.gradient_checkpointing,
        precision=precision,
        per_device_batch=pdb,
        micro_batch=micro,
        rollout_rows=rows,
        prompt_tokens=P,
        completion_tokens=T,
        reference=ref_where,
        reward_model=rm_where,
        devices=devices,
    )


# -------------------------------------------------------------------------------------- variants


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def flag(path: str, value: Any) -> str:
    """`--set path=value` as the CLI reads it back."""
    return f"--set {path}={_flag_value(value)}"


def variant(r: Resolved, changes: Mapping[str, Any]) -> Resolved:
    """A copy of `r` with `changes` applied as if given with --set (micro_batch follows a derived
    per_device_batch, as `load_job` does)."""
    job = r.job.model_copy(deep=True)
    sources = dict(r.sources)
    for path, value in changes.items():
        section, name = path.split(".", 1)
        setattr(getattr(job, section), name, list(value) if isinstance(value, tuple) else value)
        sources[path] = Source("flag", flag(path, value))
    if (
        "train.per_device_batch" in changes
        and "train.micro_batch" not in changes
        and r.source("train.micro_batch").kind == "derived"
    ):
        job.train.micro_batch = job.train.per_device_batch
    return Resolved(job=job, sources=sources, problems=list(r.problems), job_path=r.job_path)


def _evaluate(
    r: Resolved, hw: Hardware, models: Models, env: Mapping[str, str]
) -> tuple[Plan | None, list[Problem]]:
    topo, problems = resolve_topology(r, hw)
    if any(p.severity == "error" for p in problems):
        return None, problems
    return _build(r, hw, topo, models, env), problems


def _free_devices(r: Resolved, hw: Hardware, topo: Topology) -> list[int]:
    if hw.is_cpu:
        return []
    allowed = r.job.placement.devices
    pool = allowed if isinstance(allowed, list) else list(range(len(hw.devices)))
    busy = set(topo.policy_devices) | {d for d, _ in topo.scorer_devices}
    return [d for d in pool if d not in busy and d < len(hw.devices)]


def _scorer_candidates(r: Resolved, hw: Hardware, topo: Topology, roles: list[str]) -> list[dict[str, Any]]:
    """Changes that move `roles` to a dedicated scorer device: a free device first, then the last
    policy device (taking it from the policy)."""
    out = [{f"placement.{role}": [d] for role in roles} for d in _free_devices(r, hw, topo)]
    policy = list(topo.policy_devices)
    if len(policy) > 1:
        last = policy[-1]
        change: dict[str, Any] = {f"placement.{role}": [last] for role in roles}
        if isinstance(r.job.placement.policy, list):
            change["placement.policy"] = policy[:-1]
        if r.job.launch.nproc_per_node != "auto":
            change["launch.nproc_per_node"] = "auto"
        out.append(change)
    return out


def make_plan(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None, *, choose: bool = True
) -> tuple[Plan | None, list[Problem]]:
    """The plan of a resolved job on `hw` (None with the topology's problems when it cannot be laid out).

    `choose`: resolve `auto` reference/reward placements (see the module docstring); the flags that
    make the choice explicit are in `plan.sets`.
    """
    models = models or load_models(r, env)
    plan, problems = _evaluate(r, hw, models, env)
    if plan is None:
        return None, problems
    why = _why(r, plan)
    if choose:
        auto = [
            role
            for role, on in _used(r).items()
            if on
            and getattr(r.job.placement, role) == "auto"
            and not (role == "reward" and models.reward is None)
        ]
        if auto and not plan.comfortable:
            for change in _scorer_candidates(r, hw, plan.topo, auto):
                rv = variant(r, change)
                alt, alt_problems = _evaluate(rv, hw, models, env)
                if alt is not None and alt.comfortable and _divisible(rv, alt):
                    dev = next(iter(change.values()))[0]
                    why = _why(rv, alt)
                    why.append(
                        f"{' and '.join(auto)}: auto -> dedicated scorer device {dev}: colocated, device "
                        f"{plan.tightest.label} would keep only {plan.tightest.headroom:.0%} free (< {HEADROOM:.0%})"
                    )
                    alt.sets = [flag(k, v) for k, v in change.items()]
                    alt.why = why
                    return alt, alt_problems
        for role in auto:
            why.append(
                f"{role}: auto -> colocated on every policy rank"
                + (
                    " (no extra process or transfer; scoring runs in parallel on every rank)"
                    if plan.comfortable
                    else " (no dedicated layout is comfortable either)"
                )
            )
    plan.why = why
    return plan, problems


def _why(r: Resolved, plan: Plan) -> list[str]:
    """One line per choice: what was decided, from which field, and what it costs."""
    pl, t = r.job.placement, r.job.train
    out = []
    src = r.source
    if plan.strategy == "single":
        out.append("one policy rank: no data parallelism, nothing to shard")
    elif plan.strategy == "ddp":
        rank0 = next(p for d in plan.devices for p in d.processes if p.role.startswith("policy rank"))
        out.append(
            f"placement.strategy = ddp ({src('placement.strategy')}): a full replica per rank, plus DDP's "
            f"gradient buckets ({gib(rank0.detail.get('ddp_buckets', 0))} GiB per rank)"
        )
    else:
        out.append(
            f"placement.strategy = fsdp ({src('placement.strategy')}): weights, grads and AdamW states "
            f"split {plan.shards} ways; the root module and two layers are gathered while computing"
        )
    p = plan.precision
    per_param = 4 * p.weight_bytes
    text = (
        f"model.dtype = {r.job.model.dtype}, train.precision = {t.precision}: {p.weights} weights, "
        f"{per_param} bytes per parameter for weights + grads + AdamW"
    )
    if p.autocast:
        text += f", {p.compute} autocast keeps {p.compute} copies of the weights from forward to backward"
    elif p.weight_bytes < 4:
        text += " (no fp32 master copy)"
    out.append(text)
    out.append(
        f"model.gradient_checkpointing = {str(plan.checkpointing).lower()} ({src('model.gradient_checkpointing')}); "
        f"micro-batch {plan.micro_batch} of {plan.per_device_batch} ({src('train.micro_batch')}); "
        f"{plan.rollout_rows} sequences of {plan.prompt_tokens}+{plan.completion_tokens} tokens sampled at once per rank"
    )
    if plan.reward_model == "unsized":
        out.append(f"reward.model {r.job.reward.model}: config not available, its memory is not counted")
    if isinstance(pl.reference, list) or isinstance(pl.reward, list):
        out.append(
            "placement.reference / placement.reward name device ids: dedicated scorer rank(s), as given"
        )
    return out


def _divisible(r: Resolved, plan: Plan) -> bool:
    """The generation batch still splits into whole groups (the `check` rule)."""
    t = r.job.train
    g = r.job.algorithm.num_generations
    return (t.per_device_batch * plan.topo.policy_ranks * t.steps_per_generation) % max(g, 1) == 0


# ------------------------------------------------------------------------------------------ fixes


@dataclass
class Fix:
    """A change that makes the job fit comfortably, verified by planning it."""

    kind: str
    sets: list[str]
    gpus: str | None
    plan: Plan

    def command(self) -> str:
        parts = ([f"--gpus {self.gpus}"] if self.gpus else []) + self.sets
        return " ".join(parts)

    def outcome(self) -> str:
        return "; ".join(d.summary() for d in self.plan.devices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "sets": self.sets,
            "gpus": self.gpus,
            "devices": [
                {
                    "device": d.label,
                    "total_bytes": d.total,
                    "capacity_bytes": d.capacity,
                    "headroom": round(d.headroom, 4),
                }
                for d in self.plan.devices
            ],
        }


def _make_fix(
    kind: str, r: Resolved, ranks: int, changes: Mapping[str, Any], plan: Plan, gpus: str | None
) -> Fix:
    """A Fix; its kind says when the generation batch changes (more or fewer policy ranks)."""
    t = r.job.train
    before = t.per_device_batch * ranks * t.steps_per_generation
    pdb = changes.get("train.per_device_batch", t.per_device_batch)
    after = pdb * plan.topo.policy_ranks * t.steps_per_generation
    if after != before:
        kind += f" (generation batch {before} -> {after} completions)"
    sets = [flag(k, v) for k, v in changes.items()] + [x for x in plan.sets if x not in changes]
    return Fix(kind, sets, gpus, plan)


def _divisors_below(n: int, below: int) -> list[int]:
    return [d for d in range(min(n, below - 1), 0, -1) if n % d == 0]


def saver_options(r: Resolved, base: Mapping[str, Any], *, fsdp: bool = False) -> list[dict[str, Any]]:
    """`base`, then `base` with memory savers, cheapest first: smaller micro-batches (same math, more
    accumulation steps), gradient checkpointing (~30% more compute), then (when `fsdp`) FSDP with the same."""
    t = r.job.train
    micro = t.micro_batch or t.per_device_batch
    smaller = [{"train.micro_batch": m} for m in _divisors_below(t.per_device_batch, micro)]
    levels: list[dict[str, Any]] = [{}]
    if not r.job.model.gradient_checkpointing:
        levels.append({"model.gradient_checkpointing": True})
    if fsdp and r.job.placement.strategy != "fsdp":
        levels += [{"placement.strategy": "fsdp", **lv} for lv in list(levels)]
    out = []
    for lv in levels:
        for m in [{}, *smaller]:
            out.append({**base, **lv, **m})
    return out


def find_fixes(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None, limit: int = 6
) -> list[Fix]:
    """Changes that make the job comfortable (>= 10% free on every device), cheapest first, each one
    re-planned from scratch: smaller micro-batch, gradient checkpointing, a dedicated scorer device,
    FSDP over the same GPUs, FSDP over more GPUs, fewer tokens."""
    models = models or load_models(r, env)
    chosen, _ = make_plan(r, hw, env, models)
    held = sets_to_changes(chosen.sets) if chosen is not None else {}
    if held:  # the planner's own choices (auto placements) stay as they are in every fix
        r = variant(r, held)
    base, _ = _evaluate(r, hw, models, env)
    topo = base.topo if base is not None else resolve_topology(r, hw)[0]
    job, fixes, seen = r.job, [], set()

    def attempt(kind: str, changes: dict[str, Any], hardware: Hardware = hw, gpus: str | None = None) -> bool:
        key = (tuple(sorted((k, _flag_value(v)) for k, v in changes.items())), gpus)
        if key in seen:
            return False
        seen.add(key)
        rv = variant(r, changes)
        plan, _ = make_plan(rv, hardware, env, models, choose=False)
        if plan is None or not plan.comfortable or not _divisible(rv, plan):
            return False
        fixes.append(_make_fix(kind, r, topo.policy_ranks, {**held, **changes}, plan, gpus))
        return True

    t = job.train
    micro = t.micro_batch or t.per_device_batch
    gc = job.model.gradient_checkpointing
    smaller = _divisors_below(t.per_device_batch, micro)

    def first(kind: str, options: list[dict[str, Any]]) -> bool:
        return any(attempt(kind, o) for o in options if o)

    # 1. smaller micro-batch (the same math, more accumulation steps)
    first("smaller micro-batch", [{"train.micro_batch": m} for m in smaller])
    # 2. gradient checkpointing (about 30% more compute)
    if not gc:
        first(
            "gradient checkpointing",
            [o for o in saver_options(r, {}) if o.get("model.gradient_checkpointing")],
        )
    # 3. a dedicated scorer device for colocated roles
    colocated = [
        role
        for role, on in _used(r).items()
        if on and role not in topo.dedicated_roles() and not (role == "reward" and models.reward is None)
    ]
    if colocated:
        for change in _scorer_candidates(r, hw, topo, colocated):
            if first("dedicated scorer device", saver_options(r, change)):
                break
    # 4. FSDP over the same GPUs
    if topo.policy_ranks > 1 and job.placement.strategy != "fsdp":
        first("FSDP over the same GPUs", saver_options(r, {"placement.strategy": "fsdp"}))
    # 5. FSDP over more GPUs of the same kind
    _more_gpus_fix(r, hw, topo, attempt, env, models)
    # 6. fewer tokens
    T = job.rollout.max_completion_length
    best = _largest(
        lambda v: _comfortable(r, hw, env, models, {"rollout.max_completion_length": v}), 1, T - 1
    )
    if best:
        attempt("fewer tokens", {"rollout.max_completion_length": best})
    g = job.algorithm.num_generations
    for b in range(t.per_device_batch - 1, 0, -1):
        if (b * topo.policy_ranks * t.steps_per_generation) % g:
            continue
        change: dict[str, Any] = {"train.per_device_batch": b}
        if r.source("train.micro_batch").kind != "derived":
            change["train.micro_batch"] = min(micro, b) if b % min(micro, b) == 0 else 1
        if _comfortable(r, hw, env, models, change):
            attempt("fewer completions per rank", change)
            break
    return fixes[:limit]


def find_layouts(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None
) -> list[Fix]:
    """Layouts on this hardware for a job whose explicit placement cannot be laid out (a device id that
    does not exist, a device used twice): the dedicated roles shared with the last policy device,
    colocated, or on the last device with the policy moved off it. Each one planned and comfortable."""
    models = models or load_models(r, env)
    pl = r.job.placement
    n = len(hw.devices)
    roles = [role for role, on in _used(r).items() if on and isinstance(getattr(pl, role), list)]
    if hw.is_cpu or n == 0:
        return []
    wanted = pl.policy if isinstance(pl.policy, list) else list(range(n))
    policy = [d for d in dict.fromkeys(wanted) if d < n] or list(range(n))
    keep_policy = {} if policy == wanted or not isinstance(pl.policy, list) else {"placement.policy": policy}
    nproc = {"launch.nproc_per_node": "auto"} if r.job.launch.nproc_per_node != "auto" else {}
    options: list[tuple[str, dict[str, Any]]] = []
    if roles:
        last = policy[-1]
        options.append(
            (
                f"share device {last} between policy rank and scorer",
                {
                    **keep_policy,
                    **{f"placement.{x}": [last] for x in roles},
                    "placement.allow_shared_devices": True,
                    **nproc,
                },
            )
        )
        options.append(
            ("colocate", {**keep_policy, **{f"placement.{x}": "colocate" for x in roles}, **nproc})
        )
        if len(policy) > 1:
            options.append(
                (
                    f"scorer on device {policy[-1]}, policy on {','.join(map(str, policy[:-1]))}",
                    {
                        "placement.policy": policy[:-1],
                        **{f"placement.{x}": [policy[-1]] for x in roles},
                        **nproc,
                    },
                )
            )
    elif keep_policy:
        options.append(("policy on existing devices", {**keep_policy, **nproc}))
    out = []
    for kind, layout in options:
        for change in saver_options(r, layout, fsdp=True):
            rv = variant(r, change)
            plan, _ = make_plan(rv, hw, env, models)
            if plan is not None and plan.comfortable and _divisible(rv, plan):
                out.append(_make_fix(kind, r, len(policy) * r.job.launch.nnodes, change, plan, None))
                break
    return out


def _more_gpus_fix(r: Resolved, hw: Hardware, topo: Topology, attempt, env, models) -> bool:
    """FSDP over the fewest GPUs of this kind that make the job comfortable (up to MAX_GPUS), with the
    cheapest memory savers that reach that count (smaller micro-batch, then checkpointing)."""
    if hw.is_cpu or not hw.devices:
        return False
    sizes = {d.total_bytes for d in hw.devices}
    if len(sizes) != 1:
        return False
    d0 = hw.devices[0]
    size = f"{d0.total_bytes / GiB:g}GB"
    from gpufleet.hardware import GPU_MODELS

    kind = f"{d0.name}-{size}" if d0.name in GPU_MODELS else size
    base: dict[str, Any] = {"placement.strategy": "fsdp"}
    pl = r.job.placement
    if isinstance(pl.policy, list):
        base["placement.policy"] = "auto"
    if isinstance(pl.devices, list):
        base["placement.devices"] = "auto"
    if r.job.launch.nproc_per_node != "auto":
        base["launch.nproc_per_node"] = "auto"
    t = r.job.train
    micro = t.micro_batch or t.per_device_batch
    smaller = _divisors_below(t.per_device_batch, micro)
    options = [base] + [{**base, "train.micro_batch": m} for m in smaller]
    if not r.job.model.gradient_checkpointing:
        gc = {**base, "model.gradient_checkpointing": True}
        options += [gc] + [{**gc, "train.micro_batch": m} for m in smaller]

    def fits_on(change: dict[str, Any], n: int) -> bool:
        plan, _ = make_plan(variant(r, change), parse_gpu_spec(f"{n}x{kind}"), env, models)
        return plan is not None and plan.comfortable

    start = len(hw.devices) + 1
    best: tuple[int, int] | None = None  # (gpus, option index)
    for i, change in enumerate(options):
        hi = MAX_GPUS if best is None else best[0] - 1
        if hi < start or not fits_on(change, hi):
            continue
        lo = start
        while lo < hi:  # fewest GPUs: more GPUs only shrink the shards
            mid = (lo + hi) // 2
            if fits_on(change, mid):
                hi = mid
            else:
                lo = mid + 1
        best = (lo, i)
    if best is None:
        return False
    n, i = best
    spec = f"{n}x{kind}"
    return attempt(f"FSDP over {n} GPUs", options[i], parse_gpu_spec(spec), spec)


def _comfortable(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models, changes: Mapping[str, Any]
) -> bool:
    """Comfortable with `changes`, the placement held as `r` has it (no new auto choice)."""
    plan, _ = make_plan(variant(r, changes), hw, env, models, choose=False)
    return plan is not None and plan.comfortable


def _largest(ok, lo: int, hi: int) -> int | None:
    """The largest v in [lo, hi] with ok(v), for ok monotone (true then false); None if ok(lo) fails."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------------------- largest that fits


@dataclass(frozen=True)
class Largest:
    """The largest value of one field that keeps the plan comfortable, the others held."""

    field: str
    current: int
    largest: int | None
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "current": self.current, "largest": self.largest, "note": self.note}


def largest_that_fits(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None, cap: int = 1 << 20
) -> list[Largest]:
    """Max train.per_device_batch, algorithm.num_generations and rollout.max_completion_length on
    this hardware, each with the other fields held (10% headroom)."""
    models = models or load_models(r, env)
    job = r.job
    t, ro, g = job.train, job.rollout, job.algorithm.num_generations
    plan, _ = make_plan(r, hw, env, models)
    if plan is None:
        return []
    ranks, spg = plan.topo.policy_ranks, t.steps_per_generation
    # The planner's own choices (auto placements) are held too.
    held = sets_to_changes(plan.sets)
    base = variant(r, held) if held else r

    def ok(changes: Mapping[str, Any]) -> bool:
        return _comfortable(base, hw, env, models, changes)

    out = []
    micro_derived = r.source("train.micro_batch").kind == "derived"
    step = 1 if micro_derived else max(t.micro_batch or 1, 1)
    hi = _grow(lambda b: ok({"train.per_device_batch": b * step}), cap // step)
    pdb_max = hi * step if hi else None
    note = "micro-batch = per_device_batch" if micro_derived else f"in multiples of micro_batch {step}"
    if pdb_max:
        whole = [b for b in range(pdb_max, 0, -step) if (b * ranks * spg) % g == 0]
        if whole and whole[0] != pdb_max:
            note += f"; {whole[0]} keeps whole groups of {g} ({ranks} ranks x {spg} steps)"
    out.append(Largest("train.per_device_batch", t.per_device_batch, pdb_max, note))
    total = t.per_device_batch * ranks * spg
    groups = [d for d in range(total, 1, -1) if total % d == 0]
    out.append(
        Largest(
            "algorithm.num_generations",
            g,
            groups[0] if groups and plan.comfortable else None,
            f"memory does not depend on G (per_device_batch counts completions); G must divide the "
            f"generation batch {total} = {t.per_device_batch} x {ranks} ranks x {spg} steps",
        )
    )
    limit = (models.policy.arch.max_positions or cap) - ro.max_prompt_length
    best_t = _grow(lambda v: ok({"rollout.max_completion_length": v}), max(min(limit, cap), 0))
    out.append(
        Largest(
            "rollout.max_completion_length",
            ro.max_completion_length,
            best_t,
            f"prompt {ro.max_prompt_length} held"
            + (f"; the model's context allows {limit}" if models.policy.arch.max_positions else ""),
        )
    )
    return out


def sets_to_changes(sets: list[str]) -> dict[str, Any]:
    """`["--set placement.reference=3"]` -> `{"placement.reference": [3]}` (the planner's own flags)."""
    out: dict[str, Any] = {}
    for item in sets:
        path, _, text = item.removeprefix("--set ").partition("=")
        if text in ("true", "false"):
            out[path] = text == "true"
        elif path.startswith("placement.") and text.replace(",", "").isdigit():
            out[path] = [int(x) for x in text.split(",")]
        else:
            out[path] = int(text) if text.isdigit() else text
    return out


def _grow(ok, cap: int) -> int | None:
    """Largest v in [1, cap] with ok(v) (monotone), by doubling then bisection."""
    if cap < 1 or not ok(1):
        return None
    lo = 1
    while lo < cap:
        nxt = min(lo * 2, cap)
        if not ok(nxt):
            return _largest(ok, lo, nxt - 1) if nxt - 1 > lo else lo
        lo = nxt
    return lo


# -------------------------------------------------------------------------------- the check rule


def _dominant_field(d: DeviceLoad) -> str:
    state = d.weights + d.grads + d.optimizer
    parts = {
        "placement.strategy": state,
        "train.micro_batch": d.phase("train"),
        "rollout.max_completion_length": d.phase("rollout"),
    }
    return max(parts, key=lambda k: parts[k])


def breakdown(d: DeviceLoad) -> str:
    """`weights 7.10 + grads 7.10 + optimizer 14.19 + other 1.02 + the largest phase of activations
    2.31 / kv cache 0.50 / scoring 0.00 GiB`."""
    return (
        f"weights {gib(d.weights)} + grads {gib(d.grads)} + optimizer {gib(d.optimizer)} + other {gib(d.other)} "
        f"+ the largest phase of activations {gib(d.phase('train'))} / kv cache {gib(d.phase('rollout'))} / "
        f"scoring {gib(d.phase('scoring'))} / optimizer step {gib(d.phase('optimizer step'))} GiB"
    )


def fit_problems(ctx) -> list[Problem]:
    """The `gpufleet check` rule: the job must fit every device with 10% headroom.

    `ctx` is `gpufleet.config.checks.Context`. An error when a device is predicted over its memory, a
    warning when it keeps less than 10% free, each with fixes verified by planning them. Nothing when
    the model cannot be sized offline (the model.path rule warns about that) or the layout is invalid
    (the topology rules report it).
    """
    r, hw, env = ctx.r, ctx.hw, ctx.env
    if not ctx.topo.policy_devices:
        return []
    try:
        models = load_models(r, env)
    except UserError:
        return []  # not sizable offline: the model.path rule says so
    try:
        plan, _ = make_plan(r, hw, env, models)
    except UserError as e:
        return [Problem("error", [r.ref("model.path")], str(e), e.fix or "", extra={"rule": "fit"})]
    if plan is None:
        return []
    out: list[Problem] = []
    if plan.sets:
        out.append(
            Problem(
                "warning",
                [r.ref(s.split("=", 1)[0].removeprefix("--set ")) for s in plan.sets],
                "an auto placement does not fit colocated; the planner puts it on a dedicated scorer device.",
                " ".join(plan.sets) + " (make it explicit)",
                extra={"rule": "fit"},
            )
        )
    if plan.comfortable:
        return out
    d = plan.tightest
    fixes = find_fixes(r, hw, env, models, limit=3)
    refs = [r.ref(_dominant_field(d)), r.ref("model.path")]
    for path in ("train.micro_batch", "model.gradient_checkpointing", "placement.strategy"):
        if path not in {x.path for x in refs}:
            refs.append(r.ref(path))
    where = "the CPU's RAM" if d.index is None else f"device {d.label} ({', '.join(d.roles)})"
    if not d.fits:
        why = (
            f"{where} needs {gib(d.total)} GiB ({breakdown(d)}) but has {gib(d.capacity)} GiB: "
            f"{models.policy.path} has {models.policy.params.total / 1e9:.2f}B parameters."
        )
    else:
        why = (
            f"{where} would keep only {d.headroom:.0%} of its {gib(d.capacity)} GiB free "
            f"({gib(d.total)} GiB: {breakdown(d)}); plans keep >= {HEADROOM:.0%} for fragmentation."
        )
    fix = (
        "; or ".join(f.command() for f in fixes) if fixes else "use GPUs with more memory or a smaller model"
    )
    out.append(
        Problem("error" if not d.fits else "warning", refs, why, fix + " (gpufleet plan shows each device)")
    )
    return out
