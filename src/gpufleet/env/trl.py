"""A TRL environment class (`GRPOTrainer(environment_factory=...)`'s contract) as a text environment.

TRL 1.16's contract, run unchanged: one instance per episode; `reset(**kwargs)` returns None or text
(appended to the last user message: here the first prompt); the class's public functions (not `reset`,
not `get_reward`, no leading `_`: TRL's `inspect.getmembers(type(env), inspect.isfunction)`) are the
tools the policy calls; an optional `get_reward()` (sync or async) scores the episode.

THE RULE (`is_trl_env`): a class with a `reset` function and no `step` attribute is a TRL environment;
a class with `step` is a Gymnasium-style text environment (env/base.py). A dict of such classes by name
(`{"coding": CodingEnv, "game": GameEnv}`) is TRL's dict form: each episode's data row names its
environment in the column `environment` (`is_trl_envs`).

`TrlEnv` wraps one instance in gpufleet's text API, so env servers, LocalPool, their supervision,
replay after a crash and env.reset_timeout / env.step_timeout apply as to any environment:

    reset(seed=, options=)  the class's reset(**row): `options` {"row": the episode's data row, minus
                    `environment`; "environment": its name (dict form)}; no options (check's trial of
                    a job without data): reset() with no arguments, the dict form's first environment.
                    The observation is its text ("" for None)
    step(action)    `action` is the policy's assistant message as JSON: {"content": str, "tool_calls":
                    [{"type": "function", "function": {"name", "arguments"}}, ...]}. With tool calls:
                    each runs on the instance (an exception, an unknown name or bad arguments becomes
                    the result {'error': '...'}: TRL's form), the observation is the JSON list of the
                    `tool` messages, info["tool_calls"] / info["tool_failures"] count them; the episode
                    goes on. Without: the episode ends (terminated), as TRL's tool loop does.
    reward          get_reward() after each step minus its value after the previous one: an episode's
                    rewards sum to get_reward() at its end (TRL calls it once, at the end), however the
                    episode ends (the policy stops calling tools, or gpufleet truncates it).

Python's `random` (and numpy's global generator, if numpy is loaded) is seeded from the episode's seed
and kept per instance, so an episode replays exactly from (seed, actions) and the G episodes of a group
start from the same state (TRL's note: "for identical states within a group, have reset() derive the
state deterministically"). Torch-free.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import sys
from collections.abc import Callable
from typing import Any

from gpufleet.env.base import as_reward
from gpufleet.usercode import tool_failure

RESERVED = ("reset", "get_reward")


def is_trl_env(obj: Any) -> bool:
    """THE RULE: a class with a `reset` function and no `step` attribute."""
    return (
        inspect.isclass(obj) and inspect.isfunction(getattr(obj, "reset", None)) and not hasattr(obj, "step")
    )


def is_trl_envs(obj: Any) -> bool:
    """TRL's dict form: a non-empty dict of TRL environment classes by name."""
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(k, str) and is_trl_env(v) for k, v in obj.items())
    )


def classes(obj: Any) -> dict[str | None, type]:
    """{name: class} of a TRL environment class ({None: it}, as TRL normalises) or of the dict form."""
    return dict(obj) if isinstance(obj, dict) else {None: obj}


COLUMN = "environment"
"""The data column that names an episode's environment (TRL's field), with the dict form."""


def tool_names(cls: type) -> list[str]:
    """The class's tools, as TRL lists them: its public functions but `reset` and `get_reward`."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    ]


def tool_schemas(cls: type) -> list[dict]:
    """The JSON schema of each tool (transformers' `get_json_schema` of the bound method, as TRL builds
    it), without running the class's constructor. Raises what get_json_schema raises, with the name."""
    from transformers.utils import get_json_schema

    blank = object.__new__(cls)  # a bound method needs an instance; its __init__ need not run
    out = []
    for name in tool_names(cls):
        try:
            out.append(get_json_schema(getattr(blank, name)))
        except Exception as e:
            raise ToolSchemaError(name, e) from None
    return out


class ToolSchemaError(ValueError):
    def __init__(self, name: str, e: Exception):
        self.name = name
        super().__init__(f"{name}: {e}")


def message(content: str, tool_calls: list | None) -> str:
    """The action `step` takes: an assistant message as JSON (the trainer's side builds it)."""
    return json.dumps({"content": content, "tool_calls": list(tool_calls or [])})


class TrlEnv:
    """One instance of the user's TRL environment class behind gpufleet's text API (module docstring)."""

    instructions = ""
    is_trl = True  # env/base.py's errors say so: their fix is TRL's contract (env/connect.py)

    def __init__(self, envs: type | dict[str, type], kwargs: dict[str, Any]):
        self._classes, self._kwargs = classes(envs), dict(kwargs)
        self.env: Any = None
        if None in self._classes:  # one class: made now (its constructor's errors show at start)
            self._make(self._classes[None])
        else:  # the dict form: made at reset, once the episode's row names it
            self.class_name = "/".join(c.__name__ for c in self._classes.values())
        self._last = 0.0
        self._state: tuple = ()

    def _make(self, cls: type) -> None:
        self.class_name = cls.__name__  # what heartbeats and errors call it (env/table.py)
        self.env = cls(**self._kwargs)
        self.tools = {name: getattr(self.env, name) for name in tool_names(cls)}
        self._scores = callable(getattr(self.env, "get_reward", None))

    def reset(self, *, seed: int, options: Any = None) -> tuple[str, dict]:
        options = options or {}
        if None not in self._classes:
            name = options.get(COLUMN, next(iter(self._classes)) if not options else None)  # check: the 1st
            if name not in self._classes:
                raise ValueError(
                    f"Example has `environment={name!r}`, which is not among the environments passed to "
                    f"`environment_factory`. Expected one of: {list(self._classes)}."
                )
            self._make(self._classes[name])
        rng = random.Random(seed)
        self._state = (rng.getstate(), _numpy_state(seed))
        self._last = 0.0
        text = self._seeded(self.env.reset, **dict(options.get("row") or {}))
        if text is not None and not isinstance(text, str):
            raise TypeError(f"reset() returned {type(text).__name__}; TRL's contract is None or str")
        return text or "", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        said = _parse(action)
        calls = said.get("tool_calls") or []
        if not calls:
            return "", self._reward(), True, False, {}
        messages, failures = [], 0
        for call in calls:
            name, content, failed = self._call(call)
            messages.append({"role": "tool", "name": name, "content": content})
            failures += failed
        info = {"tool_calls": len(calls), "tool_failures": failures}
        return json.dumps(messages), self._reward(), False, False, info

    def describe_action(self, action: str) -> str:
        """An action as a heartbeat or a timeout quotes it: "tool calls unlock(n=41)" or the answer."""
        said = _parse(action)
        calls = [c.get("function", {}) for c in said.get("tool_calls") or [] if isinstance(c, dict)]
        if calls:
            text = ", ".join(
                f"{f.get('name')}({', '.join(f'{k}={v!r}' for k, v in (f.get('arguments') or {}).items())})"
                for f in calls
                if isinstance(f, dict)
            )
            return f"tool calls {text if len(text) <= 60 else text[:57] + '...'}"
        content = str(said.get("content", ""))
        return f"answer {content if len(content) <= 40 else content[:37] + '...'!r}"

    def close(self) -> None:
        close = getattr(self.env, "close", None) if self.env is not None else None
        if callable(close):
            close()

    def _call(self, call: Any) -> tuple[str, str, bool]:
        """(name, result text, failed) of one tool call, TRL's way."""
        function = call.get("function", {}) if isinstance(call, dict) else {}
        name = str(function.get("name", "unknown")) if isinstance(function, dict) else "unknown"
        try:
            if not isinstance(call, dict) or call.get("type", "function") != "function":
                raise ValueError(
                    f"Unsupported tool call type: {call.get('type') if isinstance(call, dict) else call}"
                )
            if name not in self.tools:
                raise ValueError(f"Tool {name} not found.")
            args = function.get("arguments") or {}
            if not isinstance(args, dict):
                raise TypeError(f"arguments must be a mapping, got {args!r}")
            return name, str(self._seeded(self.tools[name], **args)), False
        except (
            Exception,
            SystemExit,
        ) as e:  # the tool's failure is its result (TRL's form); the episode goes on
            return name, str({"error": tool_failure(name, e)}), True

    def _reward(self) -> float:
        if not self._scores:
            return 0.0
        value = self._seeded(self.env.get_reward)
        now = as_reward(value)
        if not math.isfinite(now):
            raise ValueError(
                f"{self.class_name}.get_reward() returned {value!r}; TRL's contract: a finite number"
            )
        delta, self._last = now - self._last, now
        return delta

    def _seeded(self, fn: Callable, *args, **kwargs) -> Any:
        """`fn(...)` with the episode's own state of the global random generators, awaited if async."""
        outer = (random.getstate(), _numpy_get())
        random.setstate(self._state[0])
        _numpy_set(self._state[1])
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            return out
        finally:
            self._state = (random.getstate(), _numpy_get())
            random.setstate(outer[0])
            _numpy_set(outer[1])


def _parse(action: str) -> dict:
    try:
        said = json.loads(action)
    except ValueError:
        return {"content": action}
    return said if isinstance(said, dict) else {"content": action}


async def _awaited(awaitable):
    return await awaitable


def _numpy_state(seed: int) -> Any:
    np = sys.modules.get("numpy")
    return None if np is None else np.random.RandomState(seed % 2**32).get_state()


def _numpy_get() -> Any:
    np = sys.modules.get("numpy")
    return None if np is None else np.random.get_state()


def _numpy_set(state: Any) -> None:
    np = sys.modules.get("numpy")
    if np is not None and state is not None:
        np.random.set_state(state)
