"""Task ``repeat``: the prompt is a letter and a colon, the answer is that letter 8 times, then <eos>.

    prompt "k:"  ->  completion "kkkkkkkk<eos>"

The smallest task that still needs the prompt: a randomly initialised tiny Qwen2 scores about 0.01
and learns it by RL alone (no warm start) in a few hundred GRPO steps, under a minute on 2 CPU cores.

How the quickstart (``examples/quickstart.yaml``) teaches it to stop (issue 17 item 8): a budget of 9
tokens, <eos> at probability 0 until 8 tokens are written (``rollout.min_completion_length`` 8, in
sampling and in every log-prob, as Hugging Face's ``min_new_tokens``; saved into the exported
generation_config), and ``letters`` + 0.3 ``stopped`` - 0.5 ``echo``, where ``stopped`` (ended right
after 8) and ``echo`` (copied a 9th letter) are scaled by the letter score. Measured for train.seed
0-4 (400 steps, dapo; "greedy": prompts a..z for which HF ``generate`` on the exported model writes
exactly "xxxxxxxx<eos>"): ``letters``, mean of the last 20 steps, 0.996, 0.991, 0.993, 0.998, 0.996
(the 20-step mean first >= 0.8 at step 252, 214, 189, 183, 187); clipped (no <eos>) 0.002, 0.027,
0.002, 0.000, 0.041; greedy 26, 24, 26, 26, 25 of 26 (the misses: 9 of the letter, or no <eos>
within 12 tokens).

What did not work, and why the scaling matters (same budget and minimum length unless said):

* Budget 8 (the earlier quickstart): learns the letters on every seed (>= 0.99 by step 400 for
  seeds 0-7) but never stops: the exported model writes "kkkkkkkk" and goes on.
* Without a minimum length (budgets 9-16, ``chars``, ``chars`` + ``stops``, bonuses, ``dr_grpo``,
  ``scale_rewards`` batch, beta 0.04): either the letters come first and <eos> at position 9 dies (a
  completion that stops early pushes <eos> down at every position), or a letter-free stop signal wins
  first and the letters collapse onto one letter.
* Unscaled stop rewards (``letters`` + 0.1 or 0.5 x "ended after 8" - 0.5 x "9th is the letter"):
  the stop is learned by step 60, but in groups whose letters are all wrong the stop is the only
  difference, and the group's standard deviation scales it to a full advantage: the letters the
  stopping completions happened to write are reinforced, entropy falls before the copy is learned,
  and several prompts collapse onto one letter. ``letters`` at step 400 over seeds 0-4: 0.52-1.0
  (greedy 17-25 of 26). ``scale_rewards: none`` (no scaling) made it worse: every prompt -> "nnnnnnnn".
* Stop rewards paid only when all 8 letters are right: the letters are learned fastest (0.8 by
  step 149, seed 1), but the first stops come only at step ~220 and 400 steps are too few (clipped
  0.26, greedy 16 of 26). Scaling by the letter score instead starts the stop signal as the letters
  grow and leaves random letters nothing to reinforce.
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


def stops(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """Dense reward in [0, 1] for ending at the target's length n, whatever the characters: 1 at
    length n, falling to 0 at length 0 and, twice as fast, at length 1.5 n (12 for "kkkkkkkk").

    With a budget of 1.5 n a completion that never emits <eos> scores 0 and any <eos> after the first
    token scores more, so a random model is paid for stopping at all, then for stopping in the right place.
    """
    targets = column(columns, "target", len(completions), "repeat/stops")
    return [length_score(len(as_text(c)), len(str(t))) for c, t in zip(completions, targets, strict=True)]


def length_score(length: int, n: int) -> float:
    """1 at ``length == n``; linear to 0 at 0 and at 1.5 n; 0 beyond. An empty target wants length 0."""
    if n == 0:
        return float(length == 0)
    over = length - n
    return max(0.0, 1.0 - (2 * over if over > 0 else -over) / n)


def letter_score(text: str, target: str) -> float:
    """Right characters among the first len(target), over len(target)."""
    return sum(a == b for a, b in zip(text, target, strict=False)) / max(len(target), 1)


def letters(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """Right characters among the first len(target), over len(target); what follows does not count."""
    targets = column(columns, "target", len(completions), "repeat/letters")
    return [letter_score(as_text(c), str(t)) for c, t in zip(completions, targets, strict=True)]


def stopped(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """The letter score when the completion ended right after len(target) characters, else 0.0: a stop
    is paid only as far as the letters before it are right, so stopping alone earns nothing."""
    targets = column(columns, "target", len(completions), "repeat/stopped")
    out: list[float | None] = []
    for c, t in zip(completions, targets, strict=True):
        text, target = as_text(c), str(t)
        out.append(letter_score(text, target) * float(len(text) == len(target)))
    return out


def echo(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """The letter score when the character after the target's length repeats the target's first (the
    letter copied on instead of stopping), else 0.0: a penalty, with a negative weight."""
    targets = column(columns, "target", len(completions), "repeat/echo")
    out: list[float | None] = []
    for c, t in zip(completions, targets, strict=True):
        text, target = as_text(c), str(t)
        copied = bool(target) and len(text) > len(target) and text[len(target)] == target[0]
        out.append(letter_score(text, target) * float(copied))
    return out


def exact(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the completion is exactly the target, else 0.0 (a metric more than a training signal)."""
    targets = column(columns, "target", len(completions), "repeat/exact")
    return [float(as_text(c) == str(t)) for c, t in zip(completions, targets, strict=True)]


TASK = Task(
    name="repeat",
    description="prompt 'k:' -> 'kkkkkkkk' then <eos>; rewards for the letters and for stopping",
    make_example=make_example,
    reward_functions={
        "chars": chars,
        "stops": stops,
        "exact": exact,
        "letters": letters,
        "stopped": stopped,
        "echo": echo,
    },
    default_rewards=["repeat/chars"],
    # Measured with a minimal GRPO loop (PPO-clip, ratio 1, no KL, AdamW, grad clip 1.0) on 2 shared CPU
    # cores with torch.set_num_threads(1): mean reward 0.007-0.015 at step 0; 20-step average >= 0.8
    # after 150-212 steps (7-11 s) and >= 0.99 by step 400 (~21 s), for seeds 0-7. Also >= 0.8 within
    # 233 steps with model.generate (top_k 50), untied embeddings, or AdamW defaults (wd 0.01, b2 0.999).
    # (That was with a budget of exactly 8 and ``chars``; the quickstart's stop recipe is in the docstring.)
    suggested={
        "num_generations": 8,
        "per_device_batch": 128,  # completions per optimizer step on one device: 16 prompts x 8
        "max_completion_length": LENGTH + 1,  # the letters, then <eos>
        "min_completion_length": LENGTH,
        "reward_functions": ["repeat/letters", "repeat/stopped", "repeat/echo"],
        "reward_weights": [1.0, 0.3, -0.5],
        "learning_rate": 3e-3,
        "temperature": 1.0,
        "max_steps": 400,
        "model": {  # transformers Qwen2Config kwargs, random init, character tokenizer
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
        },
    },
)
