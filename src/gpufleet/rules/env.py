"""Rules of an env job (multi-turn agent RL, the `env:` section): the environment resolves, an episode's
token budget fits the model and holds a turn, the servers fit the CPU cores, a remote address has a
token. Nothing here starts a server; the environment is made and reset once (seed 0), a user's in a child
process under a deadline (env/probe.py), so check says what train would stop on."""

from __future__ import annotations

from gpufleet import usercode
from gpufleet.errors import UserError
from gpufleet.paths import user_path
from gpufleet.rules.registry import Context, err, rule, warn


@rule
def env_resolvable(ctx: Context):
    cfg = ctx.job.env
    if not cfg.name:
        return
    from gpufleet.env import probe, source

    folders, slow = usercode.roots(ctx.r.job_path), None
    try:
        if source.is_users(cfg.name) and not cfg.address:  # remote servers run their own
            from gpufleet.rules.trlenv import first_options

            options = first_options(ctx)  # a TRL environment's first data row, as train resets with it
            slow = probe.probe(cfg.name, dict(cfg.kwargs), folders, cfg.reset_timeout, options)
        else:
            source.check(cfg.name, dict(cfg.kwargs), folders)
    except UserError as e:
        yield err([ctx.ref(e.field or "env.name")], getattr(e, "why", None) or e.message, e.fix)
        return
    if slow is not None:
        yield warn([ctx.ref(slow.field or "env.name")], slow.message, slow.fix or "")


@rule
def env_budget(ctx: Context):
    cfg, ro = ctx.job.env, ctx.job.rollout
    if not cfg.name:
        return
    budget = cfg.episode_tokens()
    if budget < cfg.max_action_tokens:
        yield err(
            [ctx.ref("env.max_episode_tokens"), ctx.ref("env.max_action_tokens")],
            f"an episode's budget of {budget} tokens cannot hold one action of {cfg.max_action_tokens}.",
            f"--set env.max_episode_tokens={cfg.max_turns * (cfg.max_action_tokens + cfg.max_observation_tokens)}"
            f" (or unset it), or --set env.max_action_tokens={budget}",
        )
    m = ctx.model
    if not m or not m.max_position_embeddings:
        return
    limit, total = m.max_position_embeddings, ro.max_prompt_length + budget
    if total > limit:
        room = limit - ro.max_prompt_length
        turns = room // (cfg.max_action_tokens + cfg.max_observation_tokens) if room > 0 else 0
        fix = (
            f"--set env.max_episode_tokens={room} (episodes that would pass it are truncated)"
            + (f", or --set env.max_turns={turns}" if turns >= 1 and cfg.max_episode_tokens is None else "")
            if room >= cfg.max_action_tokens
            else f"--set rollout.max_prompt_length={limit // 4} --set env.max_episode_tokens={limit - limit // 4}"
        )
        yield err(
            [
                ctx.ref("rollout.max_prompt_length"),
                ctx.ref("env.max_episode_tokens"),
                ctx.ref("env.max_turns"),
                ctx.ref("model.path"),
            ],
            f"prompt {ro.max_prompt_length} + episode {budget} tokens (env.max_turns {cfg.max_turns} x (action "
            f"{cfg.max_action_tokens} + observation {cfg.max_observation_tokens}) unless env.max_episode_tokens "
            f"is set) = {total} exceeds the model's max_position_embeddings {limit}.",
            fix,
        )


@rule
def env_servers_fit_cores(ctx: Context):
    cfg = ctx.job.env
    if not cfg.name or cfg.address or cfg.servers == 0:
        return
    if ctx.hw.devices and not ctx.hw.is_detected:
        return  # a GPU what-if spec: its host's cores are not known (this machine's say nothing of them)
    local_ranks = len(ctx.topo.policy_devices)
    count = local_ranks if cfg.servers == "auto" else cfg.servers
    cores, trainers = ctx.hw.cpu_count, ctx.topo.nproc_per_node
    if count + trainers > 2 * cores:
        fewer = min(local_ranks, cores, 2 * cores - trainers)  # the most servers that fit beside the trainers
        yield warn(
            [ctx.ref("env.servers")],
            f"{count} environment servers + {trainers} trainer processes on {cores} CPU cores: "
            "they will wait on each other.",
            f"--set env.servers={fewer}"
            if 1 <= fewer < count
            else "--set env.servers=0 (the environments in the trainer processes), or fewer processes",
        )


@rule
def env_address(ctx: Context):
    cfg = ctx.job.env
    if not cfg.name:
        return
    if cfg.token_file and not cfg.address:
        yield warn([ctx.ref("env.token_file")], "env.token_file is only read with env.address.", "")
    if not cfg.address:
        return
    for address in cfg.address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            yield err(
                [ctx.ref("env.address")],
                f"env.address entry {address!r} is not host:port.",
                "write each server as host:port, e.g. --set env.address=10.0.0.5:8400,10.0.0.6:8400",
            )
    if not cfg.token_file:
        yield err(
            [ctx.ref("env.address"), ctx.ref("env.token_file")],
            "servers at env.address need the token they were started with; env.token_file is not set.",
            "--set env.token_file=PATH (a file whose first line is the token)",
        )
    elif not user_path(cfg.token_file).is_file():
        yield err(
            [ctx.ref("env.token_file")],
            f"env.token_file {cfg.token_file} does not exist.",
            "give the file holding the servers' token",
        )
    if cfg.servers not in ("auto", 0):
        yield warn(
            [ctx.ref("env.servers")], "env.servers is ignored with env.address (gpufleet starts none)."
        )
