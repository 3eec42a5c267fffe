"""Task ``repeat``: the prompt is a letter and a colon, the answer is that letter 8 times, then stop.

    prompt "k:"  ->  completion "kkkkkkkk"

The smallest task that still needs the prompt: a randomly initialised tiny Qwen2 scores about 0.01
and learns it by RL alone (no warm start) in about 200 GRPO steps, under a minute on 2 CPU cores.
The reward charges for extra characters, so with a budget longer than 8 the model must also stop;
the suggested budget is exactly 8, so it never has to (see ``TASK.suggested``), and a model trained
so does not end with <eos> (issue 17 item 8, still open).

Teaching it to stop (issue 17 item 8). Greedy counts are of the 26 prompts a..z giving "xxxxxxxx<eos>"
(HF ``generate`` on the exported model); "stops": ``completions/clipped_ratio`` 0; seed: train.seed.

* <pad> (id 0) decodes to no text, so "kkkkkkkk<pad>" read as a stop; since rl/sampling.py it is never
  sampled nor scored. Without a minimum length (budgets 9-16, rewards ``chars``, ``chars`` + ``stops``,
  bonuses, gating, ``dr_grpo``, ``scale_rewards`` batch, beta 0.04): either the letters come first and
  <eos> at position 9 dies (the copy learned for positions 2-8 carries over; a completion that stops
  early pushes <eos> down at every position), or a letter-free stop signal wins first and the letters
  collapse onto one letter. Best: budget 9, ``loss_type`` dapo, letters of the first 8 + 0.5 x stopped
  - 0.5 x (9th repeats the letter): greedy 22/26, 21/26 (seeds 0, 1), 13/26 (seed 3); seeds 2 and 4
  not by step 400.
* With ``rollout.min_completion_length`` 8 (<eos> at probability 0 before 8 tokens in sampling and in
  every log-prob, as HF's ``min_new_tokens``), budget 9, dapo, 400 steps, the stop is solved: early
  stoppers no longer exist, so nothing pushes <eos> down. ``chars`` alone: clipped 0.57, greedy 12/26
  (seed 0; the letters come first, <eos> at 9 is lost prompt by prompt). ``letters`` + 0.5 ``stopped``
  - 0.5 ``echo``: stops by step 60 on all 5 seeds (clipped 0.00-0.02 at 400), but the strong stop
  signal, paid whatever the letters, then slows them and partly collapses them (several prompts share
  a letter): ``letters`` 0.86, 0.22, 0.91, 0.80, 0.56 at step 400, greedy 23, 7, 24, 21, 17 of 26
  (seeds 0-4). Seed 0, worse: without ``echo`` (0.83), stop x letters (clipped 0.36), cosine lr (0.18),
  ``dr_grpo`` (0.06, one letter for all); 600 steps on seed 1 without ``echo``: 0.81-0.93.
* Best: the same with a stop weight of 0.1, ``letters`` + 0.1 ``stopped`` - 0.5 ``echo``
  (``examples/quickstart-eos.yaml``): it still stops by step 60, and the letters suffer less. Seeds
  0-4 at step 400 (mean of the last 20 steps): ``letters`` 1.00, 0.85, 0.91, 0.96, 0.78; clipped
  0.00, 0.01, 0.00, 0.01, 0.03; greedy 26, 24, 25, 23, 22 of 26 (the misses: another letter, or 7
  or 9 of it, then <eos>). Greedy counts are with ``min_new_tokens`` 8, which the exported
  ``generation_config.json`` carries; forced to 0, many prompts stop at once (seed 1: 16 misses,
  mostly a bare <eos>), as <eos> before 8 is never trained. 3-4 min a run here (~1 s/step on a loaded 2-core machine).

Every seed stops and 5 in 5 exports give >= 22/26, but the letters reach 0.95 by step 400 on 2 seeds
in 5 only, so the quickstart keeps the budget of 8 (no stop). Next to try: more steps (seed 1 was
still rising at 400), a curriculum on the stop weight, an entropy bonus, a larger model or batch.
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


def letters(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """Right characters among the first len(target), over len(target); what follows does not count."""
    targets = column(columns, "target", len(completions), "repeat/letters")
    return [
        sum(a == b for a, b in zip(as_text(c), str(t), strict=False)) / max(len(str(t)), 1)
        for c, t in zip(completions, targets, strict=True)
    ]


def stopped(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the completion is exactly as long as the target (it ended right after it), else 0.0."""
    targets = column(columns, "target", len(completions), "repeat/stopped")
    return [float(len(as_text(c)) == len(str(t))) for c, t in zip(completions, targets, strict=True)]


def echo(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the character after the target's length repeats the target's first (the letter copied
    on instead of stopping), else 0.0: a penalty, with a negative weight."""
    targets = column(columns, "target", len(completions), "repeat/echo")
    out: list[float | None] = []
    for c, t in zip(completions, targets, strict=True):
        text, target = as_text(c), str(t)
        out.append(float(bool(target) and len(text) > len(target) and text[len(target)] == target[0]))
    return out


def exact(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the completion is exactly the target, else 0.0 (a metric more than a training signal)."""
    targets = column(columns, "target", len(completions), "repeat/exact")
    return [float(as_text(c) == str(t)) for c, t in zip(completions, targets, strict=True)]


TASK = Task(
    name="repeat",
    description="prompt 'k:' -> 'kkkkkkkk' then stop; dense per-character reward",
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
    # max_completion_length is the answer length on purpose: with a budget of 10 the model must also
    # discover <eos> at position 8, and the reward sat at 0.8 (8 right of 10) for 1500+ steps.
    suggested={
        "num_generations": 8,
        "per_device_batch": 128,  # completions per optimizer step on one device: 16 prompts x 8
        "max_completion_length": LENGTH,
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
