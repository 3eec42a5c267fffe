"""Built-in tasks: deterministic prompt generators plus TRL-compatible reward functions.

Torch-free on purpose: `gpufleet check` imports this registry and must start fast.

Reward names are ``"<task>/<fn>"``, e.g. ``"repeat/chars"``: the task's name, a slash, and the key in
its ``reward_functions``. ``reward_names()`` lists them all; ``builtin_reward(name)`` resolves one.
"""

from __future__ import annotations

from gpufleet.tasks import add, repeat
from gpufleet.tasks.base import CHARS, RewardFn, Task

TASKS: dict[str, Task] = {t.name: t for t in (repeat.TASK, add.TASK)}


def get_task(name: str) -> Task:
    """The built-in task called ``name``; ValueError listing the known names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def reward_names() -> list[str]:
    """Every built-in reward name, as ``"<task>/<fn>"``, sorted."""
    return sorted(f"{t.name}/{fn}" for t in TASKS.values() for fn in t.reward_functions)


def builtin_reward(name: str) -> RewardFn:
    """The reward function called ``"<task>/<fn>"`` (see ``reward_names()``); ValueError otherwise."""
    task_name, sep, fn_name = name.partition("/")
    task = TASKS.get(task_name)
    if not sep or task is None or fn_name not in task.reward_functions:
        raise ValueError(
            f"unknown built-in reward {name!r}; names are '<task>/<fn>', known: {', '.join(reward_names())}"
        )
    return task.reward_functions[fn_name]


__all__ = ["CHARS", "TASKS", "RewardFn", "Task", "builtin_reward", "get_task", "reward_names"]
