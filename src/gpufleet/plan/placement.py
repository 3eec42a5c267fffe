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
from gpufleet.hardware import Hardware
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
