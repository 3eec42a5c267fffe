"""Built-in environments: small, deterministic, learnable by a randomly initialised tiny model on a CPU.
(`builtin:vault`, a task that needs a tool call in chat episodes, is in env/vault.py.)

`builtin:keys` -- a row of doors, each marked with a letter; typing the letter (`length` times: the
key's teeth) opens the door:

    k:          <- observation (door 1)
    kkkk        <- action (policy tokens, trained)
    q:          <- observation "\\nq:" (door 2)
    qqqk        <- action: 3 of 4 right
    ...

A door pays (right characters in the first `length` of the action) / `length` / `doors`, so a perfect
episode earns 1. At least one right character opens it and shows the next door; none ends the
episode (terminated, no success). An action with no letter at all is also an invalid action. Opening
every door with every character right is a success. The letters come from the reset seed only, so an
episode is replayable from (seed, actions).

Why this shape: a random-init tiny model writes the right letter about 1 time in 86 per character; with
several characters per door the first successes come often enough for GRPO to find the copy (the same
signal as the single-turn `repeat` task), and each further door is the same skill again, so the
episode reward climbs turn by turn.
"""

from __future__ import annotations

import random
import string
from typing import Any

from gpufleet.env.vault import VaultEnv

LETTERS = string.ascii_lowercase


class KeysEnv:
    """`builtin:keys`; env.kwargs: `doors` per episode (default 3), `length` characters per key
    (default 4), `letters` the doors' letters come from (default a-z)."""

    instructions = ""

    def __init__(self, doors: int = 3, length: int = 4, letters: str = LETTERS):
        for name, value in (("doors", doors), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(letters, str) or not letters or not set(letters) <= set(LETTERS):
            raise ValueError(f"letters must be some of {LETTERS}, got {letters!r}")
        self.doors, self.length, self.letters = doors, length, letters
        self._doors: list[str] = []
        self._at = 0
        self._perfect = True

    def reset(self, *, seed: int, options: Any = None) -> tuple[str, dict]:
        rng = random.Random(f"keys:{seed}")
        self._doors = [rng.choice(self.letters) for _ in range(self.doors)]
        self._at, self._perfect = 0, True
        return f"{self._doors[0]}:", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._doors or self._at >= self.doors:
            raise RuntimeError("step() before reset() or after the episode ended")
        letter = self._doors[self._at]
        right = sum(c == letter for c in action[: self.length])
        info = {"invalid_action": not any(c in LETTERS for c in action)}
        reward = right / self.length / self.doors
        self._perfect = self._perfect and right == self.length
        self._at = self._at + 1 if right else self.doors
        if self._at == self.doors:
            return "", reward, True, False, info | {"success": bool(right) and self._perfect}
        return f"\n{self._doors[self._at]}:", reward, False, False, info


BUILTIN_ENVS: dict[str, type] = {"keys": KeysEnv, "vault": VaultEnv}
"""`builtin:<name>` -> class."""
