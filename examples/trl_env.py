"""A TRL environment class, written for TRL 1.16's `GRPOTrainer(environment_factory=Vault)` and run by
gpufleet unchanged (examples/agent-trl-env.yaml names it: `env.name: trl_env.py:Vault`).

TRL's contract: one instance per rollout; `reset(**kwargs)` returns the text appended to the last user
message (here the whole prompt: the vault's number); the public methods are the tools the model calls
(their schema comes from the signature and the docstring); `get_reward()` scores the episode from the
instance's state.
"""

import random


class Vault:
    def reset(self, **kwargs) -> str | None:
        self.number = random.randint(10, 99)
        self.unlocked = False
        return f"{self.number}:"

    def unlock(self, n: int) -> str:
        """Unlock a vault.

        Args:
            n: The vault number.

        Returns:
            Whether it opened.
        """
        if n == self.number:
            self.unlocked = True
            return "open"
        return "locked"

    def get_reward(self) -> float:
        return 1.0 if self.unlocked else 0.0


def call_shape(prompts, completions, **kwargs) -> list[float]:
    """A shaping reward (TRL's reward-function signature: in chat episodes, as in TRL, prompts and
    completions are lists of messages): the share of the right call `[unlock n=41]` the episode's first
    turn starts with, so that a randomly initialised model finds the call's form character by character.
    An instruct model that knows its tool format needs none."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        target = f"[unlock n={prompt[-1]['content'].strip().rstrip(':')}]"
        first = completion[0]  # the first assistant turn: its text, or its parsed tool calls
        calls = [c["function"] for c in first.get("tool_calls") or []]
        text = (first.get("content") or "") + "".join(
            f"[{f['name']}" + "".join(f" {k}={v}" for k, v in (f.get("arguments") or {}).items()) + "]"
            for f in calls
        )
        n = 0
        while n < min(len(text), len(target)) and text[n] == target[n]:
            n += 1
        out.append(n / len(target))
    return out
