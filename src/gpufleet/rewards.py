"""Ready-made reward functions for real datasets (TRL signature), usable as `gpufleet.rewards:<name>`.

    reward:
      functions: [gpufleet.rewards:answer_match, gpufleet.rewards:answer_format]

GSM8K-style data: the `answer` column holds a worked solution ending in `#### <number>` (or just the
number). The completion's answer is the content of its last <answer>...</answer>, or else the last
number it contains; a chat completion (TRL's list of messages) is read as its messages' content.
"""

from __future__ import annotations

import re
from typing import Any

from gpufleet.tasks.base import as_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.S)


def _number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value


def reference_answer(answer: Any) -> str | None:
    """`... #### 72` -> "72"; a bare number -> itself."""
    text = str(answer)
    return _number(text.split("####")[-1])


def completion_answer(completion: Any) -> str | None:
    text = as_text(completion)
    tagged = _TAGGED.findall(text)
    return _number(tagged[-1] if tagged else text)


def answer_match(
    prompts: list, completions: list, answer: list | None = None, **_: Any
) -> list[float | None]:
    """1.0 when the completion's final number equals the reference answer's, else 0.0 (None: no answer column)."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        ref = reference_answer(a)
        out.append(None if ref is None else float(completion_answer(c) == ref))
    return out


def answer_format(prompts: list, completions: list, **_: Any) -> list[float]:
    """0.2 when the completion puts its answer in <answer>...</answer> (a small shaping reward)."""
    return [0.2 if _TAGGED.search(as_text(c)) else 0.0 for c in completions]
