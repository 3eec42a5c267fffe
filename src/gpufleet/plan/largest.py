"""The largest per_device_batch, num_generations and max_completion_length that fit, the others held.

Each is found by planning (doubling, then bisection: memory grows with each of them) with 10% free on
every device. No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.config.load import Resolved
from gpufleet.hardware import Hardware
from gpufleet.plan.change import Change, apply
from gpufleet.plan.loads import Plan
from gpufleet.plan.search import comfortable_with, make_plan
from gpufleet.plan.shape import Models, load_models


def largest_true(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
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


def smallest_true(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest v in [lo, hi] with ok(v), for ok monotone (false then true) and ok(hi) true."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def grow(ok: Callable[[int], bool], cap: int) -> int | None:
    """Largest v in [1, cap] with ok(v) (monotone), by doubling then bisection."""
    if cap < 1 or not ok(1):
        return None
    lo = 1
    while lo < cap:
        nxt = min(lo * 2, cap)
        if not ok(nxt):
            return largest_true(ok, lo, nxt - 1) if nxt - 1 > lo else lo
        lo = nxt
    return lo


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
    """Max train.per_device_batch, algorithm.num_generations and rollout.max_completion_length (an env job:
    env.max_episode_tokens) on this hardware, each with the other fields held (10% headroom)."""
    models = models or load_models(r, env)
    plan, _ = make_plan(r, hw, env, models)
    if plan is None:
        return []
    base = apply(r, plan.changes) if plan.changes else r  # the planner's own choices are held too

    def ok(field: str, value: int) -> bool:
        return comfortable_with(base, hw, env, models, (Change(field, value),))

    return [
        _per_device_batch(r, plan, ok, cap),
        _num_generations(r, plan),
        _completion_length(r, models, ok, cap),
    ]


def _per_device_batch(r: Resolved, plan: Plan, ok: Callable[[str, int], bool], cap: int) -> Largest:
    t, g = r.job.train, r.job.algorithm.num_generations
    ranks, spg = plan.topo.policy_ranks, t.steps_per_generation
    micro_derived = r.source("train.micro_batch").kind == "derived"
    step = 1 if micro_derived else max(t.micro_batch or 1, 1)
    hi = grow(lambda b: ok("train.per_device_batch", b * step), cap // step)
    pdb_max = hi * step if hi else None
    note = "micro-batch = per_device_batch" if micro_derived else f"in multiples of micro_batch {step}"
    if pdb_max:
        whole = [b for b in range(pdb_max, 0, -step) if (b * ranks * spg) % g == 0]
        if whole and whole[0] != pdb_max:
            note += f"; {whole[0]} keeps whole groups of {g} ({ranks} ranks x {spg} steps)"
    return Largest("train.per_device_batch", t.per_device_batch, pdb_max, note)


def _num_generations(r: Resolved, plan: Plan) -> Largest:
    t, g = r.job.train, r.job.algorithm.num_generations
    ranks, spg = plan.topo.policy_ranks, t.steps_per_generation
    total = t.per_device_batch * ranks * spg
    groups = [d for d in range(total, 1, -1) if total % d == 0]
    return Largest(
        "algorithm.num_generations",
        g,
        groups[0] if groups and plan.comfortable else None,
        f"memory does not depend on G (per_device_batch counts completions); G must divide the "
        f"generation batch {total} = {t.per_device_batch} x {ranks} ranks x {spg} steps",
    )


def _completion_length(r: Resolved, models: Models, ok: Callable[[str, int], bool], cap: int) -> Largest:
    """The completion's tokens: rollout.max_completion_length, or an env job's episode budget
    (env.max_episode_tokens: actions + observations after the first prompt)."""
    ro = r.job.rollout
    field = "env.max_episode_tokens" if r.job.env.name else "rollout.max_completion_length"
    positions = models.policy.arch.max_positions
    limit = (positions or cap) - ro.max_prompt_length
    best = grow(lambda v: ok(field, v), max(min(limit, cap), 0))
    return Largest(
        field,
        r.job.completion_tokens(),
        best,
        f"prompt {ro.max_prompt_length} held"
        + (f"; the model's context allows {limit}" if positions else ""),
    )
