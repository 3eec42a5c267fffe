"""Rules of a TRL environment class as env.name (TRL 1.16's `environment_factory` contract, env/trl.py):
it runs in chat episodes, its tools are its methods (each describable by transformers), and something
scores its episodes (get_reward() or reward.functions). Import errors are env.py's (the probe says them);
the chat template's support of its tools is chat.py's. No torch import."""

from __future__ import annotations

from gpufleet import usercode
from gpufleet.errors import UserError
from gpufleet.rules.registry import Context, err, rule


@rule
def trl_env_contract(ctx: Context):
    job = ctx.job
    from gpufleet.rl import trlenv

    try:
        cls = trlenv.env_class(job.env.name, usercode.roots(ctx.r.job_path))
    except UserError:  # env_resolvable says it
        return
    if cls is None:
        return
    name = job.env.name
    what = f"env.name {name} is a TRL environment class (a reset method, no step: its methods are its tools)"
    if job.env.format != "chat":
        yield err(
            [ctx.ref("env.format"), ctx.ref("env.name")],
            f"{what}; its tools are called in chat episodes.",
            "--set env.format=chat",
        )
    if job.rollout.tools:
        yield err(
            [ctx.ref("rollout.tools"), ctx.ref("env.name")],
            "rollout.tools with a TRL environment class: gpufleet runs an environment's tools where the "
            "environment runs (its server), and the functions of rollout.tools in the trainer.",
            f"make each function a method of {cls.__name__} (it is then a tool), and remove rollout.tools",
        )
    try:
        trlenv.schemas(name, cls)
    except UserError as e:
        yield err([ctx.ref("env.name")], getattr(e, "why", None) or e.message, e.fix)
    if not callable(getattr(cls, "get_reward", None)) and not job.reward.functions:
        yield err(
            [ctx.ref("env.name"), ctx.ref("reward.functions")],
            f"{what}; {cls.__name__} has no get_reward() and reward.functions is empty: nothing scores "
            "its episodes (TRL's 'No reward source provided').",
            f"give {cls.__name__} a get_reward(self) -> float, or set reward.functions",
        )
