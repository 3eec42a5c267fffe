"""Gymnasium environments with a discrete action space as text environments (`env.name: gymnasium:<id>`).

    observation  the ANSI render (FrozenLake's grid, the agent's cell as `*`), or str(obs) without one
    action       the first word of the policy's turn: an action name (`right`), its unique first letter
                 (`r`), or its index (`2`); names are Gymnasium's for the toy-text environments
    invalid      anything else: the environment is not stepped, reward 0, the same observation again
                 with a note, `info["invalid_action"] = True` -- a defined outcome, the episode goes on
                 (max_turns bounds it)

Gymnasium does the environment: `gymnasium.make(id, render_mode="ansi", **env.kwargs)`, its TimeLimit
(truncated), its seeding (`reset(seed=)`), so an episode replays exactly from (seed, actions).
"""

from __future__ import annotations

import re
from typing import Any

ACTION_NAMES: dict[str, list[str]] = {
    "FrozenLake": ["left", "down", "right", "up"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "Blackjack": ["stick", "hit"],
}
"""Action names of Gymnasium's toy-text environments, by id prefix, in action-index order."""

GOALS: dict[str, str] = {
    "FrozenLake": "Walk from S to G over the frozen lake; never step on a hole H. You are at *.",
    "CliffWalking": "Walk from x to T along the grid without falling off the cliff C.",
}

_HIGHLIGHT = re.compile(r"\x1b\[4\dm(.)\x1b\[0m")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def action_names(env_id: str, n: int) -> list[str]:
    """The names of the `n` actions of `env_id` (known toy-text ids), else "0".."n-1"."""
    base = env_id.split("/")[-1].split("-")[0]
    for prefix, names in ACTION_NAMES.items():
        if base.startswith(prefix) and len(names) == n:
            return names
    return [str(i) for i in range(n)]


def parse_action(text: str, names: list[str]) -> int | None:
    """The action index a turn's text names (name, unique first letter, or index), or None."""
    words = text.strip().lower().split()
    if not words:
        return None
    word = re.sub(r"[^a-z0-9]", "", words[0])
    if word in names:
        return names.index(word)
    initials = [n[0] for n in names]
    if len(word) == 1 and len(set(initials)) == len(initials) and word in initials:
        return initials.index(word)
    if word.isdigit() and int(word) < len(names):
        return int(word)
    return None


def render_text(env) -> str | None:
    """The ANSI render as plain text (the highlighted cell shown as `*`, the last-move line dropped)."""
    if getattr(env, "render_mode", None) != "ansi":
        return None
    frame = env.render()
    if not isinstance(frame, str):
        return None
    frame = _ANSI.sub("", _HIGHLIGHT.sub("*", frame))
    lines = [ln.rstrip() for ln in frame.splitlines() if ln.strip() and not ln.strip().startswith("(")]
    return "\n".join(lines)


class GymTextEnv:
    """`gymnasium:<id>` as a text environment; `kwargs` go to `gymnasium.make`."""

    def __init__(self, env_id: str, **kwargs: Any):
        import gymnasium

        entry = gymnasium.spec(env_id).entry_point
        creator = gymnasium.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
        render = (
            {"render_mode": "ansi"}
            if "ansi" in getattr(creator, "metadata", {}).get("render_modes", [])
            else {}
        )
        self.env = gymnasium.make(env_id, **render, **kwargs)
        space = self.env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            raise ValueError(
                f"{env_id} has the action space {space}; gymnasium:<id> takes a Discrete one "
                "(write your own text env as module:Class for others)"
            )
        self.names = action_names(env_id, int(space.n))
        goal = next((g for p, g in GOALS.items() if env_id.startswith(p)), "")
        unique = len({n[0] for n in self.names}) == len(self.names)
        short = " (or " + ", ".join(n[0] for n in self.names) + ")" if unique else ""
        self.instructions = " ".join(x for x in (goal, f"Actions: {', '.join(self.names)}{short}.") if x)
        self._obs: Any = None

    def _observation(self, note: str = "") -> str:
        text = render_text(self.env)
        body = text if text is not None else str(self._obs)
        return f"\n{note}{body}\n"

    def reset(self, *, seed: int, options: Any = None) -> tuple[str, dict]:
        self._obs, info = self.env.reset(seed=seed)
        return self._observation(), _plain(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        index = parse_action(action, self.names)
        if index is None:
            return self._observation("invalid action\n"), 0.0, False, False, {"invalid_action": True}
        self._obs, reward, terminated, truncated, info = self.env.step(index)
        info = _plain(info) | {"invalid_action": False}
        if terminated:
            info.setdefault("success", float(reward) > 0)
        return self._observation(), float(reward), bool(terminated), bool(truncated), info

    def close(self) -> None:
        self.env.close()


def _plain(info: dict) -> dict:
    """`info` with JSON-safe scalars only (numpy values become Python numbers)."""
    out = {}
    for k, v in (info or {}).items():
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, bool | int | float | str) or v is None:
            out[str(k)] = v
    return out
