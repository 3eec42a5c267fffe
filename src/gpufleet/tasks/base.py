"""The `Task` type, the character set tasks may use, and reward helpers shared by the built-in tasks.

Torch-free: `gpufleet check` imports this through `gpufleet.tasks`.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The characters of the built-in character-level tokenizer, after "<pad>" (id 0) and "<eos>" (id 1).
#: Prompts and targets of built-in tasks use only these.
CHARS: str = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?:.,;!()[]<>#'\"\n"

#: A TRL-compatible reward function: ``fn(prompts, completions, **columns) -> list[float | None]``.
RewardFn = Callable[..., list[float | None]]


@dataclass(frozen=True)
class Task:
    """A built-in task: a deterministic prompt generator plus the reward functions that score it.

    ``make_example(index, seed)`` returns a dict with a ``"prompt"`` string and the answer columns
    (e.g. ``"target"``) that the reward functions receive as keyword lists.
    ``reward_functions`` maps a short name to a reward function; the registry exposes it as
    ``"<task>/<name>"``. ``suggested`` holds hyperparameters to start from; the task module says how they were measured.
    """

    name: str
    description: str
    make_example: Callable[[int, int], dict[str, Any]]
    reward_functions: Mapping[str, RewardFn]
    default_rewards: list[str]
    suggested: dict[str, Any] = field(default_factory=dict)

    def examples(self, n: int, seed: int = 0, start: int = 0) -> list[dict[str, Any]]:
        """``n`` consecutive examples, from index ``start``."""
        return [self.make_example(i, seed) for i in range(start, start + n)]


def example_rng(name: str, index: int, seed: int) -> random.Random:
    """A generator that depends only on (task name, index, seed): same example on every rank and run."""
    if index < 0:
        raise ValueError(f"example index must be >= 0, got {index}")
    return random.Random(f"{name}:{seed}:{index}")


def as_text(completion: Any) -> str:
    """A completion as plain text, whatever shape the trainer passes.

    Strings pass through; None is ""; a conversational completion (a list of {"content": ...}
    messages, as TRL passes for chat datasets) is its concatenated content; anything else is str().
    """
    if isinstance(completion, str):
        return completion
    if completion is None:
        return ""
    if isinstance(completion, list) and all(isinstance(m, Mapping) for m in completion):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


class MissingColumn(ValueError):
    """A built-in reward was given data without a column it reads (``gpufleet check`` looks for this)."""


def column(columns: Mapping[str, Any], key: str, n: int, reward: str) -> Sequence[Any]:
    """The dataset column ``key`` for a batch of ``n`` completions; a clear error if it is missing."""
    if key not in columns:
        data = sorted(c for c in columns if c != "completion_ids")  # TRL's keyword, not a column
        raise MissingColumn(
            f"reward {reward!r} needs the dataset column {key!r}, got "
            f"{f'columns {data}' if data else 'no column besides the prompt'}; "
            f"use a dataset made by the task's make_example, which provides it"
        )
    values = columns[key]
    if len(values) != n:
        raise ValueError(f"reward {reward!r}: {len(values)} values of {key!r} for {n} completions")
    return values


def char_match(completion: str, target: str) -> float:
    """Dense score in [0, 1]: characters equal to the target at the same position, divided by
    ``max(len(target), len(completion))``. Exact match is 1; missing characters and extra characters
    both cost, so a completion must also stop at the right place to score 1."""
    denominator = max(len(target), len(completion))
    if denominator == 0:
        return 1.0
    matches = sum(a == b for a, b in zip(completion, target, strict=False))
    return matches / denominator
