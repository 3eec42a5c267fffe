"""Rules of dedicated rollout ranks (placement.rollout), generating ahead (rollout.async_steps) and the
sampler's importance-sampling correction: combinations that cannot work, each with the reason and a fix."""

from __future__ import annotations

from gpufleet.rules.registry import Context, err, rule


@rule
def generating_ahead(ctx: Context):
    job = ctx.job
    k = job.rollout.async_steps
    if not k:
        return
    refs = [ctx.ref("rollout.async_steps"), ctx.ref("placement.rollout")]
    if not ctx.topo.rollout_devices:
        yield err(
            refs,
            f"rollout.async_steps {k} generates ahead on dedicated rollout ranks, and placement.rollout is "
            "colocate: the policy ranks would sample and train one after the other anyway.",
            "give the rollout its own devices, e.g. --set placement.rollout=<a free device id>, or "
            "--set rollout.async_steps=0",
        )


@rule
def sampler_correction(ctx: Context):
    a = ctx.job.algorithm
    refs = [
        ctx.ref("algorithm.importance_sampling_clip_min"),
        ctx.ref("algorithm.importance_sampling_clip_max"),
    ]
    lo, hi = a.importance_sampling_clip_min, a.importance_sampling_clip_max
    if lo is not None and hi is not None and lo >= hi:
        yield err(
            refs,
            f"importance_sampling_clip_min {lo} >= importance_sampling_clip_max {hi}: no ratio is kept (TRL "
            "refuses it too).",
            f"--set algorithm.importance_sampling_clip_min={hi / 2:g} (or null)",
        )
    if a.importance_sampling_mode.endswith("truncate") and lo is None and hi is None:
        yield err(
            [ctx.ref("algorithm.importance_sampling_mode"), *refs],
            f"importance_sampling_mode {a.importance_sampling_mode} clamps the ratio to [clip_min, clip_max], "
            "and both are null (TRL refuses it too).",
            "--set algorithm.importance_sampling_clip_max=3.0",
        )
    if a.importance_sampling_mode.endswith("mask") and hi is None:
        yield err(
            [
                ctx.ref("algorithm.importance_sampling_mode"),
                ctx.ref("algorithm.importance_sampling_clip_max"),
            ],
            f"importance_sampling_mode {a.importance_sampling_mode} keeps the raw ratio inside its bounds, and "
            "with no upper bound a completion sampled far from the trainer's policy gets an unbounded weight "
            "(the loss becomes inf).",
            "--set algorithm.importance_sampling_clip_max=3.0 (TRL's default)",
        )
    sampled_elsewhere = bool(ctx.topo.rollout_devices)
    if sampled_elsewhere and a.importance_sampling_correction and a.loss_type == "vespo":
        yield err(
            [ctx.ref("algorithm.importance_sampling_correction"), ctx.ref("algorithm.loss_type")],
            "vespo folds the sampler's ratio into its own sequence weight (TRL's way), which gpufleet does not "
            "do yet: the rollout ranks' samples would be weighted twice or not at all.",
            "--set algorithm.importance_sampling_correction=false, or another loss_type",
        )


@rule
def environments_stay_where_played(ctx: Context):
    """A TRL environment class in process (env.servers 0) on rollout ranks: its instances live in the
    rollout rank's process (rl/rolloutplay.py), so a reward function cannot get them as TRL's
    `environments`."""
    job = ctx.job
    if not ctx.topo.rollout_devices or not job.env.name or job.env.servers != 0 or job.env.address:
        return
    from gpufleet.rules.trlenv import trl_envs

    if trl_envs(ctx) is None:
        return
    for name in _taking(ctx, "environments"):
        yield err(
            [ctx.ref("placement.rollout"), ctx.ref("reward.functions")],
            f"reward function {name} takes TRL's `environments`, and with placement.rollout the episodes "
            "are played on the rollout rank: the environment instances live in its process, not in the "
            "policy rank's where rewards are computed.",
            "--set placement.rollout=colocate, or score in the environment (get_reward) and drop the "
            "function's `environments` parameter",
        )


def _taking(ctx: Context, keyword: str) -> list[str]:
    """The job's reward functions (module:function / file.py:function) with a parameter named `keyword`
    (one that does not import is reward rules' to say)."""
    import inspect

    from gpufleet import usercode
    from gpufleet.errors import UserError

    out = []
    for name in (n for n in ctx.job.reward.functions if ":" in n):
        try:
            fn = usercode.import_object(name, usercode.roots(ctx.r.job_path))
            named = keyword in inspect.signature(fn).parameters
        except (UserError, TypeError, ValueError):
            continue
        if named:
            out.append(name)
    return out
