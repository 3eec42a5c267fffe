"""Fixes for a job that does not fit, and layouts for one that cannot be laid out on this hardware.

Every fix is verified by planning it again (`search.make_plan`); the cheapest comfortable ones are
proposed first: a smaller micro-batch, gradient checkpointing, a dedicated scorer device, FSDP over the
same GPUs, FSDP over more GPUs, fewer tokens, fewer completions per rank. No torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpufleet.config.load import Resolved
from gpufleet.hardware import GPU_MODELS, GiB, Hardware, parse_gpu_spec
from gpufleet.plan.build import roles_in_use
from gpufleet.plan.change import Change, Changes, apply, changes, flags, merge, value_of
from gpufleet.plan.largest import largest_true, smallest_true
from gpufleet.plan.loads import Plan
from gpufleet.plan.search import comfortable_with, make_plan, scorer_moves, splits_into_groups
from gpufleet.plan.shape import Models, load_models
from gpufleet.plan.speed import step_cost
from gpufleet.topology import resolve_topology

MAX_GPUS = 64
"""The most GPUs the "FSDP with more GPUs" fix considers."""


@dataclass
class Fix:
    """Changes (and maybe other GPUs) that make the job fit comfortably, verified by planning them."""

    kind: str
    changes: Changes
    gpus: str | None
    plan: Plan
    cost: float = 1.0
    """Expected time per completion relative to the job as it is (speed.py): fixes are listed by it."""
    group: int = 0
    """0: the same training on this hardware (the same math, or bf16); 1: a different optimisation
    (LoRA); 2: other GPUs, or less trained per step (fewer tokens or completions). Listed in this order."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More keys for `to_dict` (a rollout split's generation share: plan/split.py)."""

    def command(self) -> str:
        """`--gpus 4x24GB --set placement.strategy=fsdp`: what to add to the command line."""
        return " ".join(
            ([f"--gpus {self.gpus}"] if self.gpus else []) + ([flags(self.changes)] if self.changes else [])
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "sets": [c.flag() for c in self.changes],
            "gpus": self.gpus,
            "expected_time_per_completion": round(self.cost, 3),
            "group": self.group,
            "host": self.plan.host.to_dict() if self.plan.host else None,
            "devices": [
                {
                    "device": d.label,
                    "roles": d.roles,
                    "total_bytes": d.total,
                    "capacity_bytes": d.capacity,
                    "headroom": round(d.headroom, 4),
                }
                for d in self.plan.devices
            ],
        } | self.extra


def _make_fix(kind: str, r: Resolved, ranks: int, cs: Changes, plan: Plan, gpus: str | None) -> Fix:
    """A Fix; its kind says when the generation batch changes (more or fewer policy ranks). The plan's
    own choices (auto placements) are part of it."""
    t = r.job.train
    before = t.per_device_batch * ranks * t.steps_per_generation
    after = (
        value_of(cs, "train.per_device_batch", t.per_device_batch)
        * plan.topo.policy_ranks
        * t.steps_per_generation
    )
    if after != before:
        kind += f" (generation batch {before} -> {after} completions)"
    cost = step_cost(r.job, cs, ranks, plan.topo.policy_ranks)
    if gpus is not None or any(c.field in _DATA_FIELDS for c in cs):
        group = 2
    else:
        group = 1 if value_of(cs, "model.use_peft", r.job.model.use_peft) != r.job.model.use_peft else 0
    return Fix(kind, merge(cs, plan.changes), gpus, plan, cost, group)


_DATA_FIELDS = ("train.per_device_batch", "rollout.max_completion_length")
"""Fields whose change trains on less per step: such fixes come after those that keep the job."""


def by_speed(fixes: list[Fix]) -> list[Fix]:
    """By group (the same training first, then LoRA, then other GPUs or less data), each group fastest
    expected first (speed.py)."""
    return sorted(fixes, key=lambda f: (f.group, f.cost))


def _divisors_below(n: int, below: int) -> list[int]:
    return [d for d in range(min(n, below - 1), 0, -1) if n % d == 0]


def _smaller_micro_batches(r: Resolved) -> list[Changes]:
    """Smaller micro-batches that divide per_device_batch, largest first (the same math, more steps)."""
    t = r.job.train
    below = t.micro_batch or t.per_device_batch
    return [(Change("train.micro_batch", m),) for m in _divisors_below(t.per_device_batch, below)]


def saver_options(r: Resolved, base: Changes, *, fsdp: bool = False) -> list[Changes]:
    """`base`, then `base` with memory savers, cheapest first: smaller micro-batches (same math, more
    accumulation steps), gradient checkpointing (~30% more compute), then (when `fsdp`) FSDP with the same."""
    levels: list[Changes] = [()]
    if not r.job.model.gradient_checkpointing:
        levels.append((Change("model.gradient_checkpointing", True),))
    if fsdp and r.job.placement.strategy != "fsdp":
        levels += [(Change("placement.strategy", "fsdp"), *lv) for lv in list(levels)]
    return [merge(base, lv, m) for lv in levels for m in [(), *_smaller_micro_batches(r)]]


class _Fixes:
    """The search of `find_fixes`: each step proposes changes, `attempt` plans them and keeps the good."""

    def __init__(self, r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models, held: Changes):
        self.r, self.hw, self.env, self.models, self.held = r, hw, env, models, held
        self.topo = resolve_topology(r, hw)[0]
        self.found: list[Fix] = []
        self.seen: set[tuple[frozenset[Change], str | None]] = set()

    def attempt(
        self, kind: str, cs: Changes, hardware: Hardware | None = None, gpus: str | None = None
    ) -> bool:
        key = (frozenset(cs), gpus)
        if key in self.seen:
            return False
        self.seen.add(key)
        rv = apply(self.r, cs)
        plan, _ = make_plan(rv, hardware or self.hw, self.env, self.models, choose=False)
        if plan is None or not plan.comfortable or not splits_into_groups(rv, plan):
            return False
        self.found.append(_make_fix(kind, self.r, self.topo.policy_ranks, merge(self.held, cs), plan, gpus))
        return True

    def first(self, kind: str, options: Iterable[Changes]) -> bool:
        return any(self.attempt(kind, o) for o in options if o)

    def comfortable(self, cs: Changes) -> bool:
        return comfortable_with(self.r, self.hw, self.env, self.models, cs)

    def dedicated_scorer(self) -> None:
        used = roles_in_use(self.r).items()
        unsized = self.models.reward is None
        colocated = [
            role
            for role, on in used
            if on and role not in self.topo.dedicated_roles() and not (role == "reward" and unsized)
        ]
        for move in scorer_moves(self.r, self.hw, self.topo, colocated) if colocated else []:
            if self.first("dedicated scorer device", saver_options(self.r, move)):
                break

    def fewer_tokens(self) -> None:
        """Fewer completion tokens: rollout.max_completion_length, or an env job's episode budget."""
        job = self.r.job
        field = "env.max_episode_tokens" if job.env.name else "rollout.max_completion_length"
        best = largest_true(lambda v: self.comfortable((Change(field, v),)), 1, job.completion_tokens() - 1)
        if best:
            self.attempt("fewer tokens", (Change(field, best),))

    def fewer_completions(self) -> None:
        """The largest smaller per_device_batch that keeps whole groups (micro_batch following it)."""
        t, g = self.r.job.train, self.r.job.algorithm.num_generations
        micro = t.micro_batch or t.per_device_batch
        for b in range(t.per_device_batch - 1, 0, -1):
            if (b * self.topo.policy_ranks * t.steps_per_generation) % g:
                continue
            cs = [Change("train.per_device_batch", b)]
            if self.r.source("train.micro_batch").kind != "derived":
                cs.append(Change("train.micro_batch", min(micro, b) if b % min(micro, b) == 0 else 1))
            if self.comfortable(tuple(cs)):
                self.attempt("fewer completions per rank", tuple(cs))
                return


def find_fixes(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None, limit: int = 6
) -> list[Fix]:
    """Changes that make the job comfortable (>= 10% free on every device), cheapest first, each one
    re-planned from scratch (see the module docstring)."""
    models = models or load_models(r, env)
    chosen, _ = make_plan(r, hw, env, models)
    held = chosen.changes if chosen is not None else ()
    if held:  # the planner's own choices (auto placements) stay as they are in every fix
        r = apply(r, held)
    f = _Fixes(r, hw, env, models, held)
    f.first("smaller micro-batch", _smaller_micro_batches(r))  # the same math, more accumulation steps
    if not r.job.model.gradient_checkpointing:  # about 30% more compute
        gc = [o for o in saver_options(r, ()) if value_of(o, "model.gradient_checkpointing", False)]
        f.first("gradient checkpointing", gc)
    f.dedicated_scorer()
    if f.topo.policy_ranks > 1 and r.job.placement.strategy != "fsdp":
        f.first("FSDP over the same GPUs", saver_options(r, (Change("placement.strategy", "fsdp"),)))
    _more_gpus_fix(f)
    multi = f.topo.policy_ranks > 1
    if r.job.train.precision == "fp32" and not hw.is_cpu:  # bf16 compute; FSDP: bf16 gathered parameters
        f.first("bf16 mixed precision", saver_options(r, (Change("train.precision", "bf16"),), fsdp=multi))
    bf16 = (Change("train.precision", "bf16"),) if r.job.train.precision == "fp32" and not hw.is_cpu else ()
    offload = _offload_options(r, hw, multi, ()) + _offload_options(r, hw, multi, bf16)
    f.first("full fine-tuning with FSDP + CPU offload", offload)
    if not r.job.model.use_peft:  # a different optimisation: the base frozen, an adapter trained
        lora = (Change("model.use_peft", True), *bf16)
        with_offload = _offload_options(r, hw, multi, lora)
        f.first(
            "LoRA adapter (peft; the base model frozen)", saver_options(r, lora, fsdp=multi) + with_offload
        )
    f.fewer_tokens()
    f.fewer_completions()
    return by_speed(f.found)[:limit]


def _offload_options(r: Resolved, hw: Hardware, multi: bool, base: Changes) -> list[Changes]:
    """`base` with FSDP and placement.offload=params (GPUs, 2+ policy ranks), with the memory savers."""
    if hw.is_cpu or not multi or r.job.placement.offload != "none":
        return []
    fsdp = (Change("placement.strategy", "fsdp"), Change("placement.offload", "params"))
    return saver_options(r, merge(base, fsdp))


def _gpu_kind(hw: Hardware) -> str | None:
    """`H100-80GB` / `24GB`: the spec of more GPUs like these (None: CPU, none, or mixed sizes)."""
    if hw.is_cpu or not hw.devices or len({d.total_bytes for d in hw.devices}) != 1:
        return None
    d0 = hw.devices[0]
    size = f"{d0.total_bytes / GiB:g}GB"
    return f"{d0.name}-{size}" if d0.name in GPU_MODELS else size


def _more_gpus_fix(f: _Fixes) -> bool:
    """FSDP over the fewest GPUs of this kind that make the job comfortable (up to MAX_GPUS), with the
    cheapest memory savers that reach that count (smaller micro-batch, then checkpointing)."""
    kind = _gpu_kind(f.hw)
    if kind is None:
        return False
    r, pl = f.r, f.r.job.placement
    base = [Change("placement.strategy", "fsdp")]
    if isinstance(pl.policy, list):
        base.append(Change("placement.policy", "auto"))
    if isinstance(pl.devices, list):
        base.append(Change("placement.devices", "auto"))
    if r.job.launch.nproc_per_node != "auto":
        base.append(Change("launch.nproc_per_node", "auto"))
    options = saver_options(r, tuple(base))

    def fits_on(cs: Changes, n: int) -> bool:
        plan, _ = make_plan(apply(r, cs), _like(f.hw, f"{n}x{kind}"), f.env, f.models)
        return plan is not None and plan.comfortable

    start = len(f.hw.devices) + 1
    best: tuple[int, int] | None = None  # (gpus, option index)
    for i, cs in enumerate(options):
        hi = MAX_GPUS if best is None else best[0] - 1
        if hi < start or not fits_on(cs, hi):
            continue
        best = (smallest_true(lambda n, cs=cs: fits_on(cs, n), start, hi), i)  # more GPUs: smaller shards
    if best is None:
        return False
    n, i = best
    hw = _like(f.hw, f"{n}x{kind}")
    spec = f"{n}x{kind}" + (f",host={hw.ram_bytes / GiB:g}GB" if hw.ram_source == "stated" else "")
    return f.attempt(f"FSDP over {n} GPUs", options[i], hw, spec)


def _like(hw: Hardware, spec: str) -> Hardware:
    """The GPUs of `spec` on a host like `hw`'s (its RAM, when stated or this machine's)."""
    more = parse_gpu_spec(spec)
    return (
        more
        if hw.ram_source == "assumed"
        else replace(more, ram_bytes=hw.ram_bytes, ram_source=hw.ram_source)
    )


def _layout_options(r: Resolved, hw: Hardware, policy: list[int]) -> list[tuple[str, Changes]]:
    """Layouts that keep the job's roles on this hardware's devices (see `find_layouts`)."""
    pl = r.job.placement
    roles = [role for role, on in roles_in_use(r).items() if on and isinstance(getattr(pl, role), list)]
    wanted = pl.policy if isinstance(pl.policy, list) else list(range(len(hw.devices)))
    keep_policy = changes(
        {} if policy == wanted or not isinstance(pl.policy, list) else {"placement.policy": policy}
    )
    nproc = changes({"launch.nproc_per_node": "auto"} if r.job.launch.nproc_per_node != "auto" else {})
    if not roles:
        return [("policy on existing devices", merge(keep_policy, nproc))] if keep_policy else []
    last = policy[-1]
    on_last = changes({f"placement.{x}": [last] for x in roles})
    shared = (Change("placement.allow_shared_devices", True),)
    options = [
        (f"share device {last} between policy rank and scorer", merge(keep_policy, on_last, shared, nproc)),
        ("colocate", merge(keep_policy, changes({f"placement.{x}": "colocate" for x in roles}), nproc)),
    ]
    if len(policy) > 1:
        kind = f"scorer on device {last}, policy on {','.join(map(str, policy[:-1]))}"
        options.append((kind, merge((Change("placement.policy", policy[:-1]),), on_last, nproc)))
    return options


def find_layouts(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None
) -> list[Fix]:
    """Layouts on this hardware for a job whose explicit placement cannot be laid out (a device id that
    does not exist, a device used twice): the dedicated roles shared with the last policy device,
    colocated, or on the last device with the policy moved off it. Each one planned and comfortable;
    listed as the fixes are (`by_speed`: fastest expected first)."""
    models = models or load_models(r, env)
    n = len(hw.devices)
    if hw.is_cpu or n == 0:
        return []
    pl = r.job.placement
    wanted = pl.policy if isinstance(pl.policy, list) else list(range(n))
    policy = [d for d in dict.fromkeys(wanted) if d < n] or list(range(n))
    out = []
    for kind, layout in _layout_options(r, hw, policy):
        for cs in saver_options(r, layout, fsdp=True):
            rv = apply(r, cs)
            plan, _ = make_plan(rv, hw, env, models)
            if plan is not None and plan.comfortable and splits_into_groups(rv, plan):
                out.append(_make_fix(kind, r, len(policy) * r.job.launch.nnodes, cs, plan, None))
                break
    return by_speed(out)
