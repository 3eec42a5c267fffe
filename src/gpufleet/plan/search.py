"""Roles -> devices: the plan of a job on some hardware, with the planner's own choices and why.

    plan, problems = make_plan(load_job("job.yaml"), parse_gpu_spec("3x16GB"), os.environ)

Choices. `placement.reference` / `placement.reward` set to `auto` are the planner's: colocated when
that is comfortable (no extra process, no transfer, scoring runs in parallel on every policy rank),
otherwise a dedicated scorer on a device no policy rank uses, otherwise on the last policy device
(`auto` policy only); `plan.changes` makes the choice explicit. Explicit values (colocate, device ids,
strategy, checkpointing, micro-batch) are checked, never changed: when they do not fit, `fixes.py`
proposes changes, each verified by planning it again. No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpufleet.config import precision
from gpufleet.config.load import Resolved
from gpufleet.config.problems import Problem
from gpufleet.hardware import Hardware
from gpufleet.plan.build import build, roles_in_use
from gpufleet.plan.change import Change, Changes, apply, changes
from gpufleet.plan.loads import HEADROOM, Plan
from gpufleet.plan.memory import gib
from gpufleet.plan.shape import Models, load_models
from gpufleet.topology import Topology, resolve_topology


def evaluate(
    r: Resolved, hw: Hardware, models: Models, env: Mapping[str, str]
) -> tuple[Plan | None, list[Problem]]:
    """The plan of `r` as it is (no choices), or None with the topology's problems."""
    topo, problems = resolve_topology(r, hw)
    if any(p.severity == "error" for p in problems):
        return None, problems
    return build(r, hw, topo, models, env), problems


def comfortable_with(r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models, cs: Changes) -> bool:
    """Comfortable with the changes `cs`, the placement held as `r` has it (no new auto choice)."""
    plan, _ = make_plan(apply(r, cs), hw, env, models, choose=False)
    return plan is not None and plan.comfortable


def splits_into_groups(r: Resolved, plan: Plan) -> bool:
    """The generation batch still splits into whole groups (the `check` rule)."""
    t = r.job.train
    g = r.job.algorithm.num_generations
    return (t.per_device_batch * plan.topo.policy_ranks * t.steps_per_generation) % max(g, 1) == 0


def _free_devices(r: Resolved, hw: Hardware, topo: Topology) -> list[int]:
    if hw.is_cpu:
        return []
    allowed = r.job.placement.devices
    pool = allowed if isinstance(allowed, list) else list(range(len(hw.devices)))
    busy = set(topo.policy_devices) | {d for d, _ in topo.scorer_devices}
    return [d for d in pool if d not in busy and d < len(hw.devices)]


def scorer_moves(r: Resolved, hw: Hardware, topo: Topology, roles: list[str]) -> list[Changes]:
    """Changes that move `roles` to a dedicated scorer device: a free device first, then the last
    policy device (taking it from the policy)."""
    out = [changes({f"placement.{role}": [d] for role in roles}) for d in _free_devices(r, hw, topo)]
    policy = list(topo.policy_devices)
    if len(policy) > 1:
        move = [Change(f"placement.{role}", [policy[-1]]) for role in roles]
        if isinstance(r.job.placement.policy, list):
            move.append(Change("placement.policy", policy[:-1]))
        if r.job.launch.nproc_per_node != "auto":
            move.append(Change("launch.nproc_per_node", "auto"))
        out.append(tuple(move))
    return out


def make_plan(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models | None = None, *, choose: bool = True
) -> tuple[Plan | None, list[Problem]]:
    """The plan of a resolved job on `hw` (None with the topology's problems when it cannot be laid out).

    `choose`: resolve `auto` reference/reward placements (see the module docstring); the changes that
    make the choice explicit are in `plan.changes`.
    """
    models = models or load_models(r, env)
    plan, problems = evaluate(r, hw, models, env)
    if plan is None:
        return None, problems
    auto = _auto_roles(r, models) if choose else []
    if auto and not plan.comfortable:
        moved = _dedicated_scorer(r, hw, env, models, plan, auto)
        if moved is not None:
            return moved
    plan.why = why(r, plan)
    for role in auto:
        plan.why.append(
            f"{role}: auto -> colocated on every policy rank"
            + (
                " (no extra process or transfer; scoring runs in parallel on every rank)"
                if plan.comfortable
                else " (no dedicated layout is comfortable either)"
            )
        )
    return plan, problems


def _auto_roles(r: Resolved, models: Models) -> list[str]:
    """The scoring roles in use whose placement is `auto` (a reward model that cannot be sized is left)."""
    return [
        role
        for role, on in roles_in_use(r).items()
        if on
        and getattr(r.job.placement, role) == "auto"
        and not (role == "reward" and models.reward is None)
    ]


def _dedicated_scorer(
    r: Resolved, hw: Hardware, env: Mapping[str, str], models: Models, colocated: Plan, auto: list[str]
) -> tuple[Plan, list[Problem]] | None:
    """The first comfortable plan with the `auto` roles on a dedicated scorer device, or None."""
    for move in scorer_moves(r, hw, colocated.topo, auto):
        rv = apply(r, move)
        alt, alt_problems = evaluate(rv, hw, models, env)
        if alt is not None and alt.comfortable and splits_into_groups(rv, alt):
            tight = colocated.tightest
            alt.why = why(rv, alt)
            alt.why.append(
                f"{' and '.join(auto)}: auto -> dedicated scorer device {move[0].value[0]}: colocated, device "
                f"{tight.label} would keep only {tight.headroom:.0%} free (< {HEADROOM:.0%})"
            )
            alt.changes = move
            return alt, alt_problems
    return None


def why(r: Resolved, plan: Plan) -> list[str]:
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
    mixed = precision.fsdp_mixed(r.job, plan.shards)
    if mixed:
        text += (
            f"; FSDP2 mixed precision: each unit gathered in {p.compute} and freed after use, gradients "
            f"reduced in float32 (no autocast copies)"
        )
    elif p.autocast:
        text += f", {p.compute} autocast keeps {p.compute} copies of the weights from forward to backward"
    elif p.weight_bytes < 4:
        text += " (no fp32 master copy)"
    out.append(text)
    out.append(
        f"model.gradient_checkpointing = {str(plan.checkpointing).lower()} ({src('model.gradient_checkpointing')}); "
        f"micro-batch {plan.micro_batch} of {plan.per_device_batch} ({src('train.micro_batch')}); "
        f"{plan.rollout_rows} sequences of {plan.prompt_tokens}+{plan.completion_tokens} tokens sampled at once per rank"
    )
    if plan.strategy == "fsdp" and plan.reference == "colocate":
        out.append(
            f"reference colocated under FSDP: sharded {plan.shards} ways like the policy (frozen, "
            f"{precision.reference_dtype(r.job)}), its root and two layers gathered while it scores"
        )
    if plan.strategy == "fsdp" and plan.reward_model == "colocate":
        out.append(
            f"reward model colocated under FSDP: sharded {plan.shards} ways (frozen, "
            f"{precision.reward_model_dtype(r.job)}), its root and two layers gathered while it scores"
        )
    if plan.host is not None and plan.host.offloaded:
        out.append(
            f"placement.offload = {pl.offload} ({src('placement.offload')}): the policy's sharded weights, "
            f"grads and AdamW states in host RAM ({gib(plan.host.offloaded)} GiB per node), AdamW steps on "
            "the CPU"
        )
    if isinstance(pl.reference, list) or isinstance(pl.reward, list):
        out.append(
            "placement.reference / placement.reward name device ids: dedicated scorer rank(s), as given"
        )
    return out
