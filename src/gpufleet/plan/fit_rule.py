"""The `gpufleet check` fit rule: the job must fit every device with 10% headroom, or say how to make it.

No torch import.
"""

from __future__ import annotations

from gpufleet.config.problems import FieldRef, Problem, Source
from gpufleet.errors import UserError
from gpufleet.plan.change import flags
from gpufleet.plan.fixes import find_fixes
from gpufleet.plan.loads import HEADROOM, LOADING_WHY, DeviceLoad
from gpufleet.plan.memory import gib
from gpufleet.plan.overhead import BadSetting, overhead_bytes
from gpufleet.plan.search import make_plan
from gpufleet.plan.shape import Models, load_models


def _dominant_field(d: DeviceLoad, env_job: bool = False) -> str:
    state = d.weights + d.grads + d.optimizer
    parts = {
        "placement.strategy": state,
        "train.micro_batch": d.phase("train"),
        "env.max_episode_tokens" if env_job else "rollout.max_completion_length": d.phase("rollout"),
    }
    return max(parts, key=lambda k: parts[k])


def breakdown(d: DeviceLoad) -> str:
    """`weights 7.10 + optimizer 14.19 + other 1.02 + the largest phase of train 9.41 (activations 2.31 +
    grads 7.10) / rollout 0.50 / scoring 0.00 / optimizer step 7.10 GiB`: each phase with the gradients
    it holds (plan/loads.py)."""
    train, grads = d.phase("train"), d.held("train") - d.phase("train")
    return (
        f"weights {gib(d.weights)} + optimizer {gib(d.optimizer)} + other {gib(d.other)} + the largest phase of "
        f"train {gib(d.held('train'))} (activations {gib(train)} + grads {gib(grads)}) / rollout "
        f"{gib(d.held('rollout'))} / scoring {gib(d.held('scoring'))} / optimizer step "
        f"{gib(d.held('optimizer step'))} GiB"
    )


def _too_full(d: DeviceLoad, models: Models) -> str:
    """Why device `d` does not fit (or is tight), with its bytes by component."""
    where = "the CPU's RAM" if d.index is None else f"device {d.label} ({', '.join(d.roles)})"
    if not d.fits:
        rm = models.reward if any("reward model" in role for role in d.roles) else None
        also = f", the reward model {rm.path} {rm.params.total / 1e9:.2f}B" if rm else ""
        return (
            f"{where} needs {gib(d.total)} GiB ({breakdown(d)}) but has {gib(d.capacity)} GiB: "
            f"{models.policy.path} has {models.policy.params.total / 1e9:.2f}B parameters{also}."
        )
    return (
        f"{where} would keep only {d.headroom:.0%} of its {gib(d.capacity)} GiB free "
        f"({gib(d.total)} GiB: {breakdown(d)}); plans keep >= {HEADROOM:.0%} for fragmentation."
    )


def _short_of_free_memory(r, hw, env, models: Models, plan) -> list[Problem]:
    """Detected GPUs whose free memory now (NVML: other processes hold some) is below what the plan puts
    on them, though the card itself would hold it; the fix: GPUs with room, or changes verified by
    planning them on the free memory."""
    from gpufleet import preflight

    need = {d.index: d.total for d in plan.devices if d.index is not None and d.fits and d.total}
    free = {i: hw.devices[i].free_bytes for i in need if i < len(hw.devices)}
    if not any(f is not None and f < need[i] for i, f in free.items()):
        return []
    room = preflight.with_room(hw, max(need.values()))
    options = []
    if len(room) >= len(need):
        ids = ",".join(str(d.index) for d in room[: len(need)])
        options.append(f"--set placement.devices={ids} (idle GPUs with room)")
    options += [f.command() for f in find_fixes(r, hw.free_as_total(), env, models, limit=2)]
    fix = "; or ".join(options) or "free memory on those GPUs (nvidia-smi lists what holds it)"
    refs = [r.ref("placement.devices"), r.ref("train.micro_batch")]
    return preflight.short_of_memory(hw, need, refs, fix + " (gpufleet plan shows each device)")


def fit_problems(ctx) -> list[Problem]:
    """The `gpufleet check` rule: the job must fit every device with 10% headroom.

    `ctx` is `gpufleet.rules.Context`. An error when a device is predicted over its memory, a
    warning when it keeps less than 10% free, each with fixes verified by planning them. Nothing when
    the model cannot be sized offline (the model.path rule warns about that) or the layout is invalid
    (the topology rules report it).
    """
    r, hw, env = ctx.r, ctx.hw, ctx.env
    if not ctx.topo.policy_devices:
        return []
    try:
        overhead_bytes(env, gpu=not hw.is_cpu)
    except BadSetting as e:
        ref = FieldRef(e.name, e.value, Source("env", e.name))
        return [Problem("error", [ref], e.why, e.fix or "", extra={"rule": "fit"})]
    try:
        models = load_models(r, env)
    except UserError:
        return []  # not sizable offline: the model.path rule says so
    plan, _ = make_plan(r, hw, env, models)
    if plan is None:
        return []
    out: list[Problem] = []
    if plan.changes:
        out.append(
            Problem(
                "warning",
                [r.ref(c.field) for c in plan.changes],
                "an auto placement does not fit colocated; the planner puts it on a dedicated scorer device.",
                flags(plan.changes) + " (make it explicit)",
                extra={"rule": "fit"},
            )
        )
    out += _short_of_free_memory(r, hw, env, models, plan)
    if plan.comfortable:
        return out
    fixes = find_fixes(r, hw, env, models, limit=3)
    if all(d.comfortable for d in plan.devices):  # the host RAM is what does not hold it
        return [*out, _host_problem(r, hw, plan, fixes)]
    d = plan.tightest
    refs = [r.ref(_dominant_field(d, bool(r.job.env.name))), r.ref("model.path")]
    for path in ("train.micro_batch", "model.gradient_checkpointing", "placement.strategy"):
        if path not in {x.path for x in refs}:
            refs.append(r.ref(path))
    why = _too_full(d, models)
    fix = (
        "; or ".join(f.command() for f in fixes) if fixes else "use GPUs with more memory or a smaller model"
    )
    out.append(
        Problem(
            "error" if not d.fits else "warning",
            refs,
            why,
            fix + " (gpufleet plan shows each device)",
            extra={"rule": "fit"},  # `train --force` turns this error into a warning
        )
    )
    return out


def _host_problem(r, hw, plan, fixes) -> Problem:
    """The host RAM of a node cannot hold what offload or loading the models puts there (with 10% free)."""
    h = plan.host
    if h.at_load:
        what = (
            f"loading the models takes {gib(h.loading)} GiB of each node's host RAM: {h.processes} processes "
            f"at once, each of which {LOADING_WHY}"
        )
        options = [f.command() for f in fixes] + ["fewer processes per node (launch.nproc_per_node)"]
        refs = [r.ref("model.path"), r.ref("launch.nproc_per_node"), r.ref("placement.strategy")]
    else:
        what = (
            f"placement.offload={r.job.placement.offload} puts {gib(h.offloaded)} GiB of training state in "
            "each node's host RAM"
        )
        options = [f.command() for f in fixes] + ["--set placement.offload=none"]
        refs = [r.ref("placement.offload"), r.ref("placement.strategy"), r.ref("model.path")]
    if h.source == "assumed":
        options.append("state the host's real RAM: --gpus SPEC,host=SIZE")
    why = (
        f"{what} (+ {gib(h.overhead)} GiB for {h.processes} processes): {gib(h.total)} GiB, but the "
        f"host has {gib(h.capacity)} GiB ({h.where()}; plans keep >= {HEADROOM:.0%} free)."
    )
    return Problem(
        "error" if not h.fits else "warning", refs, why, "; or ".join(options), extra={"rule": "fit"}
    )
