"""Rules of a TRL environment class as env.name (TRL 1.16's `environment_factory` contract, env/trl.py),
or a dict of them (TRL's dict form): it runs in chat episodes, its tools are its methods (each
describable by transformers), something scores its episodes (get_reward() or reward.functions), and the
dict form has a data file whose `environment` column names one of them on every row. Import errors are
env.py's (the probe says them), the data file's own problems resources.py's, the chat template's support
of the tools chat.py's. No torch import."""

from __future__ import annotations

from gpufleet import usercode
from gpufleet.errors import UserError
from gpufleet.rules.registry import Context, err, rule


def trl_envs(ctx: Context) -> dict | None:
    """{name: class} of the job's TRL environment(s), or None (not one, or it does not import)."""
    from gpufleet.rl import trlenv

    try:
        return trlenv.env_classes(ctx.job.env.name, usercode.roots(ctx.r.job_path))
    except UserError:  # env_resolvable says it
        return None


def reward_passes(ctx: Context) -> tuple[str, ...]:
    """TRL's keywords the job's reward functions get beyond gpufleet's: ("environments",) for a TRL
    environment in the trainer (env.servers 0), as rl/trlenv.py `passes` says for train."""
    env = ctx.job.env
    return ("environments",) if env.servers == 0 and not env.address and trl_envs(ctx) is not None else ()


def first_options(ctx: Context) -> dict | None:
    """The reset options of the first episode of a TRL environment job with a local data file (its first
    row in file order), for check's trial of the environment (env/probe.py); None otherwise."""
    from gpufleet import datafile
    from gpufleet.paths import user_path
    from gpufleet.rl.trlenv import reads_data, reset_options

    envs = trl_envs(ctx)
    data = ctx.job.data
    if envs is None or not reads_data(ctx.job) or not user_path(data.path).exists():
        return None
    try:
        rows = datafile.scan(user_path(data.path), data.prompt_field, max_rows=1, keep=True).rows
    except UserError:  # data_available says it
        return None
    return reset_options(rows[0], multi=None not in envs) if rows else None


@rule
def trl_env_contract(ctx: Context):
    from gpufleet.rl import trlenv

    job, envs = ctx.job, trl_envs(ctx)
    if envs is None:
        return
    name, names = job.env.name, ", ".join(c.__name__ for c in envs.values())
    what = (
        f"env.name {name} is a TRL environment class (a reset method, no step: its methods are its tools)"
        if None in envs
        else f"env.name {name} is TRL's dict form of environment_factory ({names})"
    )
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
            f"make each function a method of {names} (it is then a tool), and remove rollout.tools",
        )
    try:
        trlenv.schemas(name, envs)
    except UserError as e:
        yield err([ctx.ref("env.name")], getattr(e, "why", None) or e.message, e.fix)
    if not any(callable(getattr(c, "get_reward", None)) for c in envs.values()) and not job.reward.functions:
        yield err(
            [ctx.ref("env.name"), ctx.ref("reward.functions")],
            f"{what}; {names} has no get_reward() and reward.functions is empty: nothing scores "
            "its episodes (TRL's 'No reward source provided').",
            f"give {names} a get_reward(self) -> float, or set reward.functions",
        )
    if None not in envs:
        yield from _routing(ctx, envs)


def _routing(ctx: Context, envs: dict):
    """The dict form: a data file whose `environment` column names one of the environments on each row."""
    from gpufleet import datafile
    from gpufleet.env.trl import COLUMN
    from gpufleet.paths import user_path

    data = ctx.job.data
    if data.path.startswith("builtin:"):
        yield err(
            [ctx.ref("env.name"), ctx.ref("data.path")],
            f"TRL's dict form of environment_factory ({', '.join(envs)}) picks each episode's environment "
            f"by its data row's {COLUMN!r} column, and data.path is the built-in task {data.path}.",
            f"--set data.path=FILE.jsonl with a {data.prompt_field!r} and an {COLUMN!r} column (one of "
            f"{', '.join(envs)}) per row",
        )
        return
    p = user_path(data.path)
    if not p.exists():  # a hub dataset (or a missing file: data_available says so)
        return
    try:
        scan = datafile.scan(p, data.prompt_field, max_rows=datafile.check_limit(p), keep=True)
    except UserError:  # data_available says it
        return
    for k, row in enumerate(scan.rows or []):
        if row.get(COLUMN) not in envs:
            yield err(
                [ctx.ref("data.path"), ctx.ref("env.name")],
                f"row {k + 1} of {data.path} has {COLUMN}={row.get(COLUMN)!r}, not one of the environments "
                f"of env.name ({', '.join(envs)}).",
                f"give every row an {COLUMN!r} column naming one of {', '.join(envs)}",
            )
            return
