"""The table of live environments (`Episodes`) and `LocalPool`, the pool of environments in this process.

An environment server (server.py) keeps its episodes in an `Episodes`; `LocalPool` (env.servers: 0)
answers the pool calls of client.py from one in process, so both sides behave the same: a fresh
environment per reset (an existing id is replaced), the step count since reset, UnknownEpisode (404) for
an id not open, EpisodeEnded (409) for a step after the episode ended, info dicts made JSON-safe; and
both run the environments on a `Runner` (runner.py), so each call has a deadline and a voice.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from gpufleet.env import base
from gpufleet.env.base import EnvError
from gpufleet.env.runner import DEFAULT_TIMEOUT, Call, Runner, action_detail, stderr
from gpufleet.env.wire import EnvServerError, jsonable

STATS = ("requests", "retries", "replays", "lost", "duplicated")
"""The counters of a pool's `stats`."""


class UnknownEpisode(EnvServerError):
    status = 404


class EpisodeEnded(EnvServerError):
    status = 409


class _Live:
    def __init__(self, env: Any):
        self.env, self.steps, self.ended = env, 0, ""


class Episodes:
    """The live environments of one process by episode id: fresh per reset, closed on close."""

    def __init__(self, make: Callable[[], Any], name: str):
        self.make, self.name = make, name
        self.now: Call | None = None  # the environment call running now (runner.py reads it)
        self._cls = name.rsplit(":", 1)[-1]  # the class's name once one is made
        self._live: dict[str, _Live] = {}
        self._spare: Any = None

    def __len__(self) -> int:
        return len(self._live)

    def warm(self) -> None:
        """Make one environment now (kept for the first reset): constructor errors surface at start."""
        self._spare = self._spare or self._new()

    def reset(self, eid: str, seed: int, options: dict | None = None) -> tuple[str, dict]:
        old = self._live.pop(eid, None)
        if old is not None:
            _close(old.env)
        env = self._new(eid, seed)
        self.now = Call(self._cls, "reset", eid, f"seed {seed}")
        try:
            obs, info = base.checked_reset(env, seed, self.name, options)
        except EnvError:
            _close(env)
            raise
        finally:
            self.now = None
        info = jsonable(info)
        if base.instructions(env) and "instructions" not in info:
            info["instructions"] = base.instructions(env)
        self._live[eid] = _Live(env)
        return obs, info

    def check_steppable(self, ids: list[str]) -> None:
        """UnknownEpisode / EpisodeEnded for the first id that cannot be stepped."""
        for eid in ids:
            live = self._live.get(eid)
            if live is None:
                raise UnknownEpisode(
                    f"episode {eid!r} is not open here: reset it first (a restarted server has none)"
                )
            if live.ended:
                raise EpisodeEnded(f"episode {eid!r} has {live.ended}; reset it to play again")

    def step(self, eid: str, action: str) -> tuple[str, float, bool, bool, dict, int]:
        """One step -> (observation, reward, terminated, truncated, info, steps since reset)."""
        live = self._live[eid]
        detail = getattr(live.env, "describe_action", action_detail)  # TrlEnv: its tool calls
        self.now = Call(self._cls, "step", eid, detail(action))
        try:
            obs, reward, terminated, truncated, info = base.checked_step(live.env, action, self.name)
        except EnvError:
            live.ended = "ended with an environment error"
            raise
        finally:
            self.now = None
        live.steps += 1
        if terminated or truncated:
            live.ended = "terminated" if terminated else "been truncated"
        return obs, reward, terminated, truncated, jsonable(info), live.steps

    def close(self, ids: list[str]) -> int:
        closed = [(eid, self._live.pop(eid)) for eid in dict.fromkeys(ids) if eid in self._live]
        for eid, live in closed:
            self.now = Call(self._cls, "close", eid)
            _close(live.env)
        self.now = None
        return len(closed)

    def close_all(self) -> None:
        self.close(list(self._live))

    def _new(self, eid: str = "", seed: int | None = None) -> Any:
        if self._spare is not None:
            env, self._spare = self._spare, None
            return env
        self.now = Call(self._cls, "__init__", eid, "" if seed is None else f"seed {seed}")
        try:
            env = self.make()
            self._cls = getattr(env, "class_name", type(env).__name__)  # TrlEnv: the user's class
            return env
        except Exception as e:
            raise EnvError(
                f"{self.name}: making the environment raised {type(e).__name__}: {e}{base.where(e)}"
            ) from None
        finally:
            self.now = None


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception as e:  # a failing close must not take the server down
            print(f"env close raised {type(e).__name__}: {e}{base.where(e)}", file=sys.stderr, flush=True)


class LocalPool:
    """The same calls on environments in this process (env.servers: 0): no server, no retries; each
    environment call bounded by `reset_timeout` (making it and its reset) or `step_timeout` (a step, a
    close), with heartbeats to `say` while one is slow (runner.py)."""

    def __init__(
        self,
        make: Callable[[], Any],
        name: str,
        *,
        reset_timeout: float = DEFAULT_TIMEOUT,
        step_timeout: float = DEFAULT_TIMEOUT,
        say: Callable[[str], None] = stderr,
    ):
        self.name, self.reset_timeout, self.step_timeout, self.say = name, reset_timeout, step_timeout, say
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        self.says_success = False  # an info of this pool's has had a "success" key (rl/episodes.py)
        self._table = Episodes(make, name)
        self._runner = Runner(self._table)

    def reset(self, items: list[tuple]) -> list[tuple[str, dict]]:
        """(id, seed) or (id, seed, options) -> (observation, info), in input order."""
        check_distinct([item[0] for item in items])
        self.stats["requests"] += 1
        job = lambda: [self._table.reset(*item) for item in items]  # noqa: E731
        return self._runner.run(job, self.reset_timeout, self.say)

    def step(self, items: list[tuple[str, str]]) -> list[tuple[str, float, bool, bool, dict]]:
        check_distinct([i for i, _ in items])
        self.stats["requests"] += 1
        self._table.check_steppable([eid for eid, _ in items])
        job = lambda: [self._table.step(eid, action)[:5] for eid, action in items]  # noqa: E731
        out = self._runner.run(job, self.step_timeout, self.say)
        self.says_success = self.says_success or any("success" in r[4] for r in out)
        return out

    def close(self, ids: list[str]) -> None:
        self._runner.run(lambda: self._table.close(ids), self.step_timeout, self.say)

    def shutdown(self) -> None:
        """Close every environment (not while one is stuck in a call: that one never returned)."""
        if not self._runner.stuck():
            self._runner.run(self._table.close_all, self.step_timeout, self.say)


def check_distinct(ids: list[str]) -> None:
    """ValueError if an episode id appears twice in one pool call."""
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"episode id {dup!r} appears twice in one call; one action per episode per call")
