"""Task ``add``: two-digit addition, the harder built-in task (for GPU runs and pretrained models).

    prompt "47+38="  ->  completion "85"   (or "... <answer>85</answer>" for a chat model)

The answer is the text inside the last ``<answer>...</answer>`` when the completion has one,
otherwise the whole completion with surrounding whitespace removed.
"""

from __future__ import annotations

import re
from typing import Any

from gpufleet.tasks.base import Task, as_text, char_match, column, example_rng

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"<answer>\s*-?\d+\s*</answer>")


def make_example(index: int, seed: int) -> dict[str, Any]:
    """Example ``index`` of the stream ``seed``: {"prompt": "47+38=", "target": "85"}."""
    rng = example_rng("add", index, seed)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {"prompt": f"{a}+{b}=", "target": str(a + b)}


def extract_answer(completion: str) -> str:
    """The last ``<answer>...</answer>`` content, else the completion, stripped."""
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def digits(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """Dense reward in [0, 1]: right digits at the right place / max(len(target), len(answer))."""
    targets = column(columns, "target", len(completions), "add/digits")
    return [char_match(extract_answer(as_text(c)), str(t)) for c, t in zip(completions, targets, strict=True)]


def exact(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the answer equals the target, else 0.0."""
    targets = column(columns, "target", len(completions), "add/exact")
    return [float(extract_answer(as_text(c)) == str(t)) for c, t in zip(completions, targets, strict=True)]


def answer_format(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the completion holds ``<answer>NUMBER</answer>``, else 0.0 (for chat models)."""
    return [float(_FORMAT.search(as_text(c)) is not None) for c in completions]


TASK = Task(
    name="add",
    description="two-digit addition 'a+b=' -> 'sum'; dense per-digit reward, exact and <answer> format rewards",
    make_example=make_example,
    reward_functions={"digits": digits, "exact": exact, "format": answer_format},
    default_rewards=["add/digits"],
    # Not shown to reach 0.8 yet: a random-init Qwen2 (hidden 128, 4 layers) on 2 CPU cores went from
    # 0.01 to 0.27 in 150 s (477 steps) and stalled there. These are starting points for a longer run,
    # not measured settings; a pretrained chat model wants add/exact + add/format and ~64 tokens.
    suggested={
        "num_generations": 8,
        "per_device_batch": 128,  # completions per optimizer step on one device: 16 prompts x 8
        "max_completion_length": 3,
        "learning_rate": 1e-3,
        "temperature": 1.0,
        "max_steps": 5000,
        "model": {  # transformers Qwen2Config kwargs, random init, character tokenizer
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
        },
    },
)
