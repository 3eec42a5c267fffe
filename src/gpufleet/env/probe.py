"""`gpufleet check`'s trial of a user's environment: import it, make one and reset it (seed 0), in a fresh
Python process under a short deadline, so that what `train` would stop on 10-30 s in is said by `check`,
and a constructor or a reset that hangs cannot hang `check`.

    probe(name, kwargs, folders, reset_timeout)  -> None, or a warning (a UserError, not raised);
                                                    raises UserError for what train would stop on
    python -m gpufleet.env.probe < spec.json     (the child: one JSON line on stdout)

The child does what a trainer rank does with env.servers: 0 (source.factory, then LocalPool.reset under
env.reset_timeout), so its errors are train's: an import error or env.kwargs that do not fit (the field
and the fix), a constructor or reset that raises (the exception's last line and the env's file:line),
a reset that returns the old Gym shape (an observation alone), a call that does not return (where it is
stuck). It is given min(env.reset_timeout, PROBE_S) s per call: a call slower than that is an error when
env.reset_timeout is that short too (train would stop), a warning otherwise (a simulator may be slow on
purpose). The child is killed past its deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from gpufleet.errors import UserError

PROBE_S = 10.0
"""Seconds check gives making the environment and its reset (each)."""
START_S = 20.0
"""Seconds the child may take beyond that (Python, gpufleet and the user's module importing)."""


def probe(
    name: str, kwargs: dict[str, Any], folders: list[str], reset_timeout: float, options: dict | None = None
) -> UserError | None:
    """`options`: the reset options train gives the first episode (a TRL environment's data row)."""
    from gpufleet.env.connect import env_failed, env_stuck
    from gpufleet.env.runner import EnvTimeout
    from gpufleet.env.servers import child_env

    limit = min(reset_timeout, PROBE_S)
    spec = json.dumps(
        {"name": name, "kwargs": kwargs, "folders": folders, "limit": limit, "options": options}
    )
    cmd = [sys.executable, "-m", "gpufleet.env.probe"]
    try:
        done = subprocess.run(
            cmd,
            input=spec,
            capture_output=True,
            text=True,
            env=child_env(folders),
            timeout=2 * limit + START_S,
        )
    except subprocess.TimeoutExpired:  # killed: stuck where no deadline of ours reaches (an import)
        return UserError(
            f"check tried {name} (import it, make one, reset it) and gave up after {2 * limit + START_S:g} s.",
            field="env.name",
            fix="make sure importing the module and making the environment do not wait forever",
        )
    lines = done.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except ValueError:
        out = {}
    if "ok" in out:
        return None
    if "user_error" in out:
        raise UserError(**out["user_error"])
    if "env_error" in out:
        raise env_failed(out["env_error"], when=" when check made one and reset it (seed 0), as train does")
    if "timeout" in out:
        if reset_timeout <= limit:
            raise env_stuck(EnvTimeout(out["timeout"]))
        wire = out["timeout"]
        where = f" (it is at {wire['where']})" if wire.get("where") else ""
        return UserError(
            f"{wire['call']} did not return within the {limit:g} s check gives it{where}; not an error "
            f"if it is slow on purpose: train gives it env.reset_timeout {reset_timeout:g} s.",
            field="env.reset_timeout",
            fix="if it should be quick, find why it does not return there",
        )
    last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    raise UserError(f"check could not try {name}: {last}", field="env.name", fix="see the message")


def main() -> None:
    """The child: try the environment of the spec on stdin; one JSON line on stdout; exit at once (a
    stuck call's thread is not waited for)."""
    from gpufleet.env.base import EnvError
    from gpufleet.env.runner import EnvTimeout
    from gpufleet.env.source import factory
    from gpufleet.env.table import LocalPool

    spec = json.loads(sys.stdin.read())
    try:
        make = factory(spec["name"], spec["kwargs"], spec["folders"])
        pool = LocalPool(make, spec["name"], reset_timeout=spec["limit"], say=lambda _: None)
        pool.reset([("check", 0, *([spec["options"]] if spec.get("options") is not None else []))])
        out: dict[str, Any] = {"ok": True}
    except UserError as e:
        out = {
            "user_error": {"message": getattr(e, "why", None) or e.message, "field": e.field, "fix": e.fix}
        }
    except EnvTimeout as e:
        out = {"timeout": e.wire}
    except EnvError as e:
        out = {"env_error": str(e)}
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
