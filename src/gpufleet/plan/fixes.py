"""Fixes for a job that does not fit, "largest that fits", and the `gpufleet check` fit rule.

Every fix is verified by planning it again (`placement.make_plan`); the cheapest comfortable ones are
proposed first: a smaller micro-batch, gradient checkpointing, a dedicated scorer device, FSDP over the
same GPUs, FSDP over more GPUs, fewer tokens. No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.config.load import Resolved
from gpufleet.config.problems import Problem
from gpufleet.errors import UserError
from gpufleet.hardware import GiB, Hardware, parse_gpu_spec
from gpufleet.plan.memory import (
    gib,
)
from gpufleet.plan.placement import (
    HEADROOM,
    MAX_GPUS,
    DeviceLoad,
    Models,
    Plan,
    _divisible,
    _evaluate,
    _flag_value,
    _scorer_candidates,
    _used,
    flag,
    load_models,
    make_plan,
    variant,
)
from gpufleet.topology import Topology, resolve_topology


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
