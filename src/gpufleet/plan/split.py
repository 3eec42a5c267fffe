"""Rollout splits: a colocated job's sampling moved to devices of its own, one step ahead of training.

    find_splits(r, parse_gpu_spec("4x24GB"), os.environ)   # [Fix, ...], fastest expected first

For a job whose policy ranks sample their own rows (`placement.rollout: colocate`) on 2+ GPUs, every
device the job may use gets a role: the policy first, then the rollout ranks (1 up to as many as policy
ranks), then, when the job scores with a reference or reward model, either the scorers colocated with the
policy or one dedicated scorer on the last device (a scorer the job already places on device ids stays
there). `rollout.async_steps` is 1: batch s + 1 is sampled while batch s trains. The generation batch is
kept when the fewer policy ranks divide it (per_device_batch raised), else it shrinks and the proposal
says so. Each layout is planned with the memory savers the fixes use (smaller micro-batch, checkpointing,
FSDP) and kept only when it is comfortable (>= 10% free on every device) and splits into whole groups.
Listed as fixes are: the same training (generation batch) first, then by expected time per completion,
`speed.split_cost` (an estimate from the job's shape, see speed.py), then the fewest rollout devices.
An env job's rollout rank plays whole episodes (rl/rolloutplay.py), and so does a job with tools on a data
set (TRL's tool loop, the tools called on the rollout rank), so both get splits too. No split for vespo with
the sampler correction (refused by `check`; so is a reward function taking TRL's `environments` of an
in-process TRL environment on rollout ranks, which this module cannot see without importing it). No torch
import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gpufleet.config.load import Resolved
from gpufleet.hardware import Hardware
from gpufleet.plan.build import roles_in_use
from gpufleet.plan.change import Change, Changes, apply, changes, merge, value_of
from gpufleet.plan.fixes import Fix, saver_options
from gpufleet.plan.loads import Plan
from gpufleet.plan.search import make_plan, splits_into_groups
from gpufleet.plan.shape import Models, load_models
from gpufleet.plan.speed import Shape, generation_share, split_cost
from gpufleet.topology import ROLES

LIMIT = 3
"""The most splits `gpufleet plan` proposes (fastest expected first)."""
MAX_ROLLOUT_DEVICES = 4
"""The most rollout devices a proposal uses (a decode step costs about the same up to 150 rows, so more
rollout ranks mostly add weight copies)."""


def find_splits(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None, limit: int = LIMIT
) -> list[Fix]:
    """Comfortable layouts with the rollout on devices of its own (see the module docstring)."""
    job = r.job
    if hw.is_cpu or job.placement.rollout != "colocate":
        return []
    if job.algorithm.loss_type == "vespo" and job.algorithm.importance_sampling_correction:
        return []
    models = models or load_models(r, env)
    chosen, _ = make_plan(r, hw, env, models)
    if chosen is None:
        return []
    found = [_planned(r, hw, env, models, layout, chosen) for layout in _layouts(r, hw, models)]
    fixes = [f for f in found if f is not None]  # same training first, fastest, fewest rollout devices
    return sorted(fixes, key=lambda f: (f.group, f.cost, len(f.plan.topo.rollout_devices)))[:limit]


def _layouts(r: Resolved, hw: Hardware, models: Models) -> list[Changes]:
    """Every device of the pool given a role: policy, then rollout, then (maybe) a dedicated scorer."""
    pl, on = r.job.placement, roles_in_use(r)
    n = len(hw.devices)
    pool = [d for d in (pl.devices if isinstance(pl.devices, list) else range(n)) if d < n]
    fixed = {
        d for role in ROLES if on[role] and isinstance(getattr(pl, role), list) for d in getattr(pl, role)
    }
    movable = [
        role
        for role in ROLES
        if on[role]
        and not isinstance(getattr(pl, role), list)
        and not (role == "reward" and models.reward is None)
    ]
    free = [d for d in dict.fromkeys(pool) if d not in fixed]
    options = [
        (free, changes({f"placement.{x}": "colocate" for x in movable if getattr(pl, x) != "colocate"}))
    ]
    if movable and len(free) >= 3:
        options.append((free[:-1], changes({f"placement.{x}": [free[-1]] for x in movable})))
    rest_of_job = [Change("rollout.async_steps", 1)]
    if r.job.launch.nproc_per_node != "auto":
        rest_of_job.append(Change("launch.nproc_per_node", "auto"))
    out = []
    for devices, scorer in options:
        for m in range(1, min(len(devices) // 2, MAX_ROLLOUT_DEVICES) + 1):
            roles = changes({"placement.policy": devices[:-m], "placement.rollout": devices[-m:]})
            out.append(merge(roles, scorer, rest_of_job))
    return out


def _batch_kept(r: Resolved, before: int, after: int) -> Changes:
    """per_device_batch (and an explicit micro_batch that no longer divides it) that keep the generation
    batch on `after` policy ranks; () when train.global_batch does it already or the ranks do not divide it."""
    t = r.job.train
    total, per_round = r.job.generation_batch(before), after * t.steps_per_generation
    if t.global_batch is not None or after == before or total % per_round:
        return ()
    b = total // per_round
    out = [Change("train.per_device_batch", b)]
    if r.source("train.micro_batch").kind != "derived" and t.micro_batch and b % t.micro_batch:
        out.append(Change("train.micro_batch", math.gcd(b, t.micro_batch)))
    return tuple(out)


def _planned(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models, layout: Changes, chosen: Plan
) -> Fix | None:
    """The first comfortable version of `layout`: the generation batch kept if it can be, the cheapest
    memory savers first; None when none is. `chosen`: the job's own plan."""
    before = chosen.topo.policy_ranks
    after = len(value_of(layout, "placement.policy", ())) * r.job.launch.nnodes
    for batch in dict.fromkeys([_batch_kept(r, before, after), ()]):
        for savers in saver_options(apply(r, batch), layout, fsdp=after > 1):
            cs = merge(batch, savers)
            rv = apply(r, cs)
            plan, _ = make_plan(rv, hw, env, models, choose=False)
            if plan is not None and plan.comfortable and splits_into_groups(rv, plan):
                cost = split_cost(r.job, cs, _shape(chosen), _shape(plan))
                extra = {"generation_share": round(generation_share(r.job, _shape(chosen)), 3)}
                same = r.job.generation_batch(before) == rv.job.generation_batch(plan.topo.policy_ranks)
                return Fix(_describe(r, plan, before), cs, None, plan, cost, 0 if same else 2, extra)
    return None


def _describe(r: Resolved, plan: Plan, before: int) -> str:
    """`policy 0,1 (FSDP), rollout 2, reference 3`, and what happens to the generation batch."""
    topo, ids = plan.topo, lambda ds: ",".join(map(str, ds))
    strategy = "one rank" if plan.strategy == "single" else plan.strategy.upper()
    parts = [f"policy {ids(topo.policy_devices)} ({strategy})", f"rollout {ids(topo.rollout_devices)}"]
    parts += [
        f"{' + '.join(x.replace('reward', 'reward model') for x in roles)} {d}"
        for d, roles in topo.scorer_devices
    ]
    colocated = [
        x
        for x, at in (("reference", plan.reference), ("reward model", plan.reward_model))
        if at == "colocate"
    ]
    if colocated:
        parts.append(f"{' + '.join(colocated)} colocated")
    if topo.nnodes > 1:
        parts.append(f"on each of {topo.nnodes} nodes")
    t = r.job.train
    was, now = (
        r.job.generation_batch(before),
        plan.per_device_batch * topo.policy_ranks * t.steps_per_generation,
    )
    if now != was:
        return ", ".join(parts) + f" (generation batch {was} -> {now} completions)"
    if plan.per_device_batch != t.per_device_batch and t.global_batch is None:
        return ", ".join(parts) + f" (generation batch {was} kept)"
    return ", ".join(parts)


def _shape(plan: Plan) -> Shape:
    topo = plan.topo
    return Shape(
        len(topo.policy_devices), len(topo.rollout_devices), len(topo.scorer_devices), plan.rollout_rows
    )
