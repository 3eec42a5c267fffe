"""Task ``repeat``: the prompt is a letter and a colon, the answer is that letter 8 times, then stop.

    prompt "k:"  ->  completion "kkkkkkkk" (then <eos>)

The smallest task that still needs the prompt: a randomly initialised tiny model scores about 0.01
and learns it by RL alone (no warm start) in a couple of minutes on 2 CPU cores.
"""

from __future__ import annotations

import string
from typing import Any

from gpufleet.tasks.base import Task, as_text, char_match, column, example_rng

LETTERS = string.ascii_lowercase
LENGTH = 8


def make_example(index: int, seed: int) -> dict[str, Any]:
    """Example ``index`` of the stream ``seed``: {"prompt": "k:", "target": "kkkkkkkk"}."""
    letter = example_rng("repeat", index, seed).choice(LETTERS)
    return {"prompt": f"{letter}:", "target": letter * LENGTH}


def chars(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """Dense reward in [0, 1]: right characters at the right place / max(len(target), len(completion))."""
    targets = column(columns, "target", len(completions), "repeat/chars")
    return [char_match(as_text(c), str(t)) for c, t in zip(completions, targets, strict=True)]


def exact(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the completion is exactly the target, else 0.0 (a metric more than a training signal)."""
    targets = column(columns, "target", len(completions), "repeat/exact")
    return [float(as_text(c) == str(t)) for c, t in zip(completions, targets, strict=True)]


TASK = Task(
    name="repeat",
    description="prompt 'k:' -> 'kkkkkkkk' then stop; dense per-character reward",
    make_example=make_example,
    reward_functions={"chars": chars, "exact": exact},
    default_rewards=["repeat/chars"],
    suggested={},
)
