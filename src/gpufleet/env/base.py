"""The text environment API every environment source gives: Gymnasium's, with text in and out.

    env = Env(**kwargs)
    observation, info = env.reset(seed=seed)
    observation, reward, terminated, truncated, info = env.step(action_text)

`observation` is text the policy reads (appended to its transcript as is, so it carries its own
separators, e.g. a leading newline); `action_text` is what the policy wrote in one turn. An optional
`instructions` attribute (text) goes before the first observation. `info` may say
`success` (bool: the episode reached its goal) and `invalid_action` (bool: the action could not be
parsed; the environment decides what that costs, it must not raise). A Gymnasium `Env` subclass with
text observations and actions is such an environment.

`checked_reset` / `checked_step` call an environment and turn anything else it returns or raises into one
`EnvError` naming the environment, what was wrong, and where in the user's code.
"""

from __future__ import annotations

import math
import traceback
from pathlib import Path
from typing import Any, Protocol


class TextEnv(Protocol):
    def reset(self, *, seed: int) -> tuple[str, dict]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]: ...


class EnvError(Exception):
    """The environment raised or returned something that is not the text API (a bug in the env)."""


def checked_reset(env: Any, seed: int, name: str, options: dict | None = None) -> tuple[str, dict]:
    """`env.reset(seed=seed)`, or with `options=` (Gymnasium's reset options) when some are given."""
    out = _call(env.reset, name, "reset", seed=seed, **({} if options is None else {"options": options}))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise EnvError(f"{name}: reset(seed=...) returned {_short(out)}; it must return (observation, info)")
    return _text(out[0], name, "reset"), _info(out[1], name, "reset")


def checked_step(env: Any, action: str, name: str) -> tuple[str, float, bool, bool, dict]:
    out = _call(env.step, name, "step", action)
    if not (isinstance(out, tuple) and len(out) == 5):
        raise EnvError(
            f"{name}: step(action) returned {_short(out)}; it must return "
            "(observation, reward, terminated, truncated, info)"
        )
    obs, reward, terminated, truncated, info = out
    reward = as_reward(reward)
    if not math.isfinite(reward):
        raise EnvError(f"{name}: step returned the reward {_short(out[1])}; it must be a finite number")
    return _text(obs, name, "step"), reward, bool(terminated), bool(truncated), _info(info, name, "step")


def as_reward(value: Any) -> float:
    """A reward as a float, NaN when it is none: anything float() takes (Gymnasium's SupportsFloat: numpy
    scalars, one-element arrays and tensors, Decimal), but not text ("1.0" is no number) or bytes."""
    if isinstance(value, (str, bytes)):
        return math.nan
    if getattr(value, "size", None) == 1 and hasattr(value, "item"):  # np.array([0.5]), a 1-element tensor
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def instructions(env: Any) -> str:
    """The environment's `instructions` text ("" when it has none)."""
    text = getattr(env, "instructions", "") or ""
    return text if isinstance(text, str) else str(text)


def _call(fn, name: str, what: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        trl = " (a TRL environment class)" if getattr(getattr(fn, "__self__", None), "is_trl", False) else ""
        raise EnvError(f"{name}{trl}: {what} raised {type(e).__name__}: {e}{where(e)}") from None


def where(e: BaseException) -> str:
    """' at file:line' of the innermost frame outside gpufleet (the user's code), or ''."""
    here = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(here)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _text(obs: Any, name: str, what: str) -> str:
    if not isinstance(obs, str):
        raise EnvError(
            f"{name}: {what} returned an observation of type {type(obs).__name__}; a text environment "
            "returns str (wrap a Gymnasium env with gymnasium:<id>, or render the observation as text)"
        )
    return obs


def _info(info: Any, name: str, what: str) -> dict:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise EnvError(f"{name}: {what} returned info of type {type(info).__name__}; it must be a dict")
    return info


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."
