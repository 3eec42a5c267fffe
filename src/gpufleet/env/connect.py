"""How a trainer rank reaches its environments (torch-free): in process, gpufleet's own servers for the
run, or servers someone else runs.

    env.servers 0        a `LocalPool` in each rank
    env.servers auto|N   the servers `gpufleet train` started, listed in OUTPUT/env/servers.json; policy
                         rank i uses those placed for its device (server j with j % ranks == i)
    env.address          an `EnvPool` over those addresses, with the token in env.token_file
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from gpufleet.errors import UserError
from gpufleet.paths import user_path


def open_pool(job, rt, run_dir: Path):
    """This rank's way to its environments: in-process (env.servers 0), gpufleet's servers for the run
    (OUTPUT/env/servers.json; this rank uses the servers placed on its device), or env.address."""
    from gpufleet.env import client

    cfg = job.env
    limits = {"reset_timeout": cfg.reset_timeout, "step_timeout": cfg.step_timeout}
    if cfg.address:
        return client.EnvPool(list(cfg.address), read_token(cfg.token_file), **limits)
    if cfg.servers == 0:
        from gpufleet.env.source import factory

        return client.LocalPool(factory(cfg.name, dict(cfg.kwargs)), cfg.name, **limits)
    servers_json = servers_file(run_dir, rt.node_rank)
    if not servers_json.exists():
        raise UserError(
            f"no environment servers for this run ({servers_json} is missing).",
            field="env.servers",
            fix="start the run with gpufleet train (it starts the servers), or give env.address",
        )
    only = server_indices(servers_json, rt, job.launch.nnodes)
    return client.EnvPool.from_file(servers_json, only=only, **limits)


def server_indices(servers_json: Path, rt, nnodes: int = 1) -> list[int]:
    """The servers of its node that a policy rank uses: those placed for its device (i % ranks == index,
    counted on the node: every node has the same layout, ranks node-major), or index % count when there
    are fewer servers than ranks."""
    count = len(json.loads(servers_json.read_text(encoding="utf-8"))["servers"])
    per_node = max(rt.policy_size // max(nnodes, 1), 1)
    local = rt.policy_index % per_node
    mine = [i for i in range(count) if i % per_node == local]
    return mine or [local % count]


def read_token(path: str | None) -> str:
    """The first line of env.token_file."""
    if not path:
        raise UserError(
            "env.address is set but env.token_file is not.",
            field="env.token_file",
            fix="give the file holding the servers' token (--set env.token_file=PATH)",
        )
    try:
        token = user_path(path).read_text(encoding="utf-8").splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError) as e:
        raise UserError(
            f"cannot read a token from env.token_file {path}: {e}.",
            field="env.token_file",
            fix="give a readable file whose first line is the token",
        ) from None
    if not token:
        raise UserError(
            f"env.token_file {path} has an empty first line.",
            field="env.token_file",
            fix="put the token there",
        )
    return token


@contextlib.contextmanager
def env_errors(job):
    """Failures of the environments or their servers during training as one-line `UserError`s: an
    environment that raises or returns junk (its file:line), a server unreachable past the retry
    window, a refused token, a non-deterministic replay."""
    from gpufleet.env.base import EnvError
    from gpufleet.env.runner import EnvTimeout
    from gpufleet.env.wire import EnvServerError

    cfg = job.env
    try:
        yield
    except EnvTimeout as e:
        raise env_stuck(e) from None
    except EnvError as e:
        raise env_failed(str(e)) from None
    except EnvServerError as e:
        remote = bool(cfg.address)
        raise UserError(
            f"environment servers: {e}.",
            field="env.address" if remote else "env.servers",
            fix="check the servers at env.address are up and env.token_file holds their token"
            if remote
            else "see OUTPUT/logs/env-server-*.log; --set env.servers=0 runs the environments in the trainer",
        ) from None


def env_stuck(e) -> UserError:
    """The error of an environment call past its limit (`e`: runner.EnvTimeout)."""
    return UserError(
        f"the environment is stuck: {e}.",
        field=e.setting,
        fix=f"find why it does not return {'there' if e.wire.get('where') else 'in time'}, or, for an "
        f"environment this slow on purpose, --set {e.setting}={4 * e.wire['limit']:g}",
    )


def env_failed(what: str, when: str = "") -> UserError:
    """The error of an environment that raised or returned junk (`what`: base.EnvError's text)."""
    trl = "TRL's contract" in what or "(a TRL environment class)" in what  # env/trl.py, env/base.py say so
    return UserError(
        f"the environment failed{when}: {what}.",
        field="env.name",
        fix="fix the environment class (TRL's environment_factory contract): reset(**row) returns None or "
        "text, each tool method text, get_reward() a number"
        if trl
        else "fix the environment: reset(seed=) returns (observation, info) and step(action) returns "
        "(observation, reward, terminated, truncated, info), text observations, never raising",
    )


def servers_file(run_dir: Path, node: int = 0) -> Path:
    """Where `gpufleet train` lists a node's environment servers (written by env/servers.py): node 0 in
    OUTPUT/env/, node N in OUTPUT/env/nodeN/ (nodes may share the output folder)."""
    env_dir = run_dir / "env" if node == 0 else run_dir / "env" / f"node{node}"
    return env_dir / "servers.json"
