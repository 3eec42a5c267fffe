"""`builtin:vault` -- a task whose answer is only reachable through a tool call (env.format: chat).

Each episode shows a vault number; its key is a letter only the tool `key` knows (a hash of the number,
26 letters, 90 numbers: a tiny model cannot guess it, 1 in 26):

    tools: key(n)                 <- the chat template offers the tool (rollout.tools: [gpufleet.env.vault:key])
    U:41:                         <- observation: the vault number
    A:[key n=41]<eos>             <- turn 1 (policy): the tool call
    T:q                           <- the tool's answer (spliced by the template, not trained)
    A:q                           <- turn 2 (policy): the answer, checked by the environment

The environment sees only turns without tool calls: the first such turn is the answer (reward 1 when
its first character is the key, `success`), and ends the episode. `call_shape` is a shaping reward
function for the job's reward.functions: the share of the right call (`[key n=41]`) that the first
action starts with, so that a randomly initialised model finds the call's form character by character.
(Crediting each position on its own instead collapsed a run onto `[k========`: `=` is right at one
position, and was then written at all of them.)
"""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any

LOW, HIGH = 10, 99


def key(n: int) -> str:
    """The key of vault number n.

    Args:
        n: The vault number.
    """
    if not LOW <= int(n) <= HIGH:
        raise ValueError(f"no vault {n}")
    return string.ascii_lowercase[hashlib.sha256(f"vault:{int(n)}".encode()).digest()[0] % 26]


class VaultEnv:
    """`builtin:vault`: a vault number per episode; the answer is its key (the tool `key` knows it)."""

    instructions = ""

    def __init__(self):
        self._n: int | None = None

    def reset(self, *, seed: int, options: Any = None) -> tuple[str, dict]:
        self._n = random.Random(f"vault:{seed}").randint(LOW, HIGH)
        return f"{self._n}:", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._n is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        right = action.strip()[:1] == key(self._n)
        self._n = None
        return "", float(right), True, False, {"success": right, "invalid_action": not action.strip()}


def call_shape(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Per episode: how much of the right call (`[key n=41]`) the transcript starts with, as a share of it."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        target = f"[key n={prompt.strip().rstrip(':')}]"
        n = 0
        while n < min(len(completion), len(target)) and completion[n] == target[n]:
            n += 1
        out.append(n / len(target))
    return out
