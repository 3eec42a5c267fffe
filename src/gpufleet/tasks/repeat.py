"""Task ``repeat``: the prompt is a letter and a colon, the answer is that letter 8 times, then stop.

    prompt "k:"  ->  completion "kkkkkkkk"

The smallest task that still needs the prompt: a randomly initialised tiny Qwen2 scores about 0.01
and learns it by RL alone (no warm start) in about 200 GRPO steps, under a minute on 2 CPU cores.
The reward charges for extra characters, so with a budget longer than 8 the model must also stop;
the suggested budget is exactly 8, so it never has to (see ``TASK.suggested``), and a model trained
so does not end with <eos> (issue 17 item 8, still open).

Teaching it to stop (issue 17 item 8), measured on the quickstart settings (128 completions/step,
lr 3e-3, temperature 1, grpo), seed 0 only, 1-3 min each. "Stops": completions/clipped_ratio 0.
"Letters": ``chars`` near its maximum for the budget.

* The built-in models' <pad> (id 0) is a live token at random init and decodes to no text, so
  "kkkkkkkk<pad>" reads "kkkkkkkk", as if it had stopped. Budget 9, 0.5 ``chars`` + 0.5 x (length 8):
  42% of completions got the length bonus by step 16, nearly all through <pad> (clipped ratio 0.98).
  Masking pad in sampling only let pad, never sampled, soak up the mass (entropy 2.4 -> 0.05 at step
  70). Masking it in sampling and in ``sequence_logprobs`` (commit 9a49936 on branch wt-demo, reverted
  since: gpufleet/rl/rollout.py is outside this task) removes that; the lines below are with it.
* Budget 9, ``chars`` alone (pad live): letters (0.71 of 0.89 at step 160); never stops (clipped 1.0
  from step 91 to 168, where it was cut). Budget 9, 0.8 ``chars`` + 0.2 x (length 8): the same at step 400 (0.71).
* Budget 12, ``chars`` + ``stops`` summed, 0.5/0.5 or 0.8/0.2: stops by step 31-36, then the letters do
  not come (``chars`` about 0.05 at steps 131-156): the length alone drives the group-normalised
  advantages of groups with no right letter, which reinforces junk. 0.8/0.2 with
  algorithm.scale_rewards=batch: the same at step 400. 0.95/0.05 with batch: stops by step 91, letters
  in part (reward 0.3-0.6 over steps 240-400, several letters mapped to "k"; greedy from the export:
  "k:" -> "kkkkkkkk<eos>", "a:" -> "qqqqqqqq<eos>"); run on to 1000 steps it stays at 0.2-0.76, then
  stops stopping (clipped 0.97 at step 961). 0.98/0.02: neither by step 400.
* Budget 12, ``chars`` x (1 + ``stops``) / 2 (stopping paid only along with a right letter): letters
  (the truncated maximum 1/3 by step 200), never stops (clipped 1.0 from step 60). With precision
  (right / produced) in place of ``chars``: neither by step 400.

Either the stop is learned first, from a letter-free signal, and the letters then come slowly, or the
letters come first and <eos> at position 9 is not sampled again. Untried: a curriculum on the budget,
an entropy bonus, more steps or seeds.
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


def exact(prompts: list[str], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 when the completion is exactly the target, else 0.0 (a metric more than a training signal)."""
    targets = column(columns, "target", len(completions), "repeat/exact")
    return [float(as_text(c) == str(t)) for c, t in zip(completions, targets, strict=True)]


TASK = Task(
    name="repeat",
    description="prompt 'k:' -> 'kkkkkkkk' then stop; dense per-character reward",
    make_example=make_example,
    reward_functions={"chars": chars, "stops": stops, "exact": exact},
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
