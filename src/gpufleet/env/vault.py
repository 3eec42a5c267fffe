"""`builtin:vault` -- a task whose answer is only reachable through a tool call (env.format: chat).

Each episode shows a vault number (0-9); its key is a letter only the tool `k` knows (the 10 vaults have
10 different keys, drawn once from a-z: nothing in the prompt tells them apart, and one letter written
every time is right 1 time in 10):

    tools: k(n)                   <- the chat template offers the tool (rollout.tools: [gpufleet.env.vault:k])
    U:7:                          <- observation: the vault number
    A:[k n=7]                     <- turn 1 (policy): the tool call
    T:q                           <- the tool's answer (spliced by the template, not trained)
    A:q                           <- turn 2 (policy): the answer, checked by the environment

The environment sees only turns without tool calls: the first such turn is the answer (reward 1 when
its first character is the key, `success`), and ends the episode. `call_shape` is a shaping reward
function for the job's reward.functions: the share of the right call (`[k n=7]`) that the first action
starts with, so that a randomly initialised model finds the call's form character by character; a wrong
digit counts half. (With the prefix alone, each of 3 seeds learned `[k n` or `[k n=` in ~150 steps and
then wrote `n`, `=` or ` ` again where the digit goes -- `[k n=n=`, `[k nnnn` --: the calls never parsed,
every episode of a group earned the same, and GRPO had no signal left.) `reads_result` is a second
shaping reward: the turn after the tool's answer starts with that answer's first character. (Without it
a run learned the whole call form by step ~270, then wrote the call again as its answer: the right key
needs the right digit and the copy at once, which random tries did not find.)

Why this shape: a random-init character model writes a given character about 1 time in 87, and the call
must be found one character at a time (measured: about 25 steps per character with 256 episodes a step);
the short tool name and the one-digit number keep it to 7 characters, and a one-digit number is copied
from the prompt as one character. (Two-digit numbers and the tool `key` -- `[key n=41]`, 10 characters
and two copies -- were not learned in 600 steps of 64 episodes. Crediting each position on its own
instead of the prefix collapsed a run onto `[k========`: `=` is right at one position, and was then
written at all of them.)
"""

from __future__ import annotations

import random
import string
from typing import Any

from gpufleet.models.builtin import CHAR_VOCAB, EOS_TOKEN_ID

VAULTS = 10
KEYS = random.Random("vault").sample(string.ascii_lowercase, VAULTS)
"""The key of vault n is KEYS[n]: 10 different letters."""


def k(n: int) -> str:
    """The key of vault n.

    Args:
        n: The vault number.
    """
    if not 0 <= int(n) < VAULTS:
        raise ValueError(f"no vault {n}")
    return KEYS[int(n)]


class VaultEnv:
    """`builtin:vault`: a vault number per episode; the answer is its key (the tool `k` knows it)."""

    instructions = ""

    def __init__(self):
        self._n: int | None = None

    def reset(self, *, seed: int, options: Any = None) -> tuple[str, dict]:
        self._n = random.Random(f"vault:{seed}").randrange(VAULTS)
        return f"{self._n}:", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._n is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        right = action.strip()[:1] == k(self._n)
        self._n = None
        return "", float(right), True, False, {"success": right, "invalid_action": not action.strip()}


def said(x: str | list[dict]) -> str:
    """A prompt or completion as the built-in chat template writes it: text as it is; TRL's message lists
    (what reward functions get in chat episodes) as the transcript after the first prompt -- the first
    assistant turn, then `T:result\n` / `U:observation\n` and `A:turn` for each message after it."""
    if isinstance(x, str):
        return x
    out = []
    for i, m in enumerate(x):
        if m.get("role") == "assistant":
            calls = [c.get("function", c) for c in m.get("tool_calls") or []]
            text = str(m.get("content") or "") + "".join(
                f"[{f['name']}"
                + (
                    " " + ",".join(f"{k}={v}" for k, v in f["arguments"].items())
                    if f.get("arguments")
                    else ""
                )
                + "]"
                for f in calls
            )
            out.append(("A:" if i else "") + text)
        else:
            out.append(("T:" if m.get("role") == "tool" else "U:") + str(m.get("content")) + "\n")
    return "".join(out)


def _number(prompt: str | list[dict]) -> str:
    """The vault number the prompt shows (text `7:`, or the last message's content)."""
    text = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    return text.strip().rstrip(":")


def sampled(ids: list[int]) -> str:
    """Token ids of the built-in character tokenizer as text, up to the first EOS: an episode's first turn
    as the policy sampled it (a reward function's `completion_ids`)."""
    out = []
    for i in ids:
        if i == EOS_TOKEN_ID:
            break
        out.append(CHAR_VOCAB[i] if 0 <= i < len(CHAR_VOCAB) else "")
    return "".join(out)


def call_shape(
    prompts: list, completions: list, completion_ids: list[list[int]] | None = None, **_: Any
) -> list[float]:
    """Per episode: how much of the right call (`[k n=7]`) the first turn starts with, as a share of it; a
    wrong digit counts half and the match goes on (`[k n=3]` for vault 7: 6.5 / 7). The turn as sampled
    (`completion_ids`, when given), else as `said` renders the completion (text or TRL's message list).
    Not the parsed call: the built-in response template reads `[k=x` as a call to `k` and renders it
    `[k =x]`, which would credit `[k=` above `[k n` and hold a run there (measured: 3 of 3 runs stuck)."""
    texts = [sampled(ids) for ids in completion_ids] if completion_ids is not None else None
    out = []
    for i, (prompt, episode) in enumerate(zip(prompts, completions, strict=True)):
        target = f"[k n={_number(prompt)}]"
        completion = texts[i] if texts is not None else said(episode)
        score = 0.0
        for i, want in enumerate(target[: len(completion)]):
            got = completion[i]
            if got != want and not (want.isdigit() and got.isdigit()):
                break
            score += 1.0 if got == want else 0.5
        out.append(score / len(target))
    return out


def reads_result(prompts: list, completions: list, **_: Any) -> list[float]:
    """Per episode: 1 when the turn after the first tool result starts with that result's first character
    (`...T:q\nA:q`): using what the tool said, right or wrong (the environment pays only the right key)."""
    out = []
    for episode in completions:
        _, tool, rest = said(episode).partition("T:")
        result, _, after = rest.partition("\nA:")
        out.append(float(bool(tool and result and after) and after[:1] == result[:1]))
    return out


SAID = 8
"""How many times `Vault.k` says the key (`T:qqqqqqqq`): for a random-init character model, a letter that
fills a third of the context is a copy learned in minutes; said once, 3 seeds did not learn it with the
entropy bonus and the KL on, and 1 of 3 did without them (docs/agents-with-tools.md)."""


class Vault:
    """The vault as a TRL environment class (`env.name: gpufleet.env.vault:Vault`, TRL's
    environment_factory contract): each episode's key is one of KEYS (drawn with the episode's seed, so
    the G episodes of a group share it), the prompt says nothing about it, and the tool `k()` -- no
    argument: the instance knows its vault -- says it (SAID times). `key_found` scores the answer."""

    def reset(self, **kwargs) -> str | None:
        self.key = random.choice(KEYS)
        return "key:"

    def k(self) -> str:
        """The key of this vault."""
        return self.key * SAID


def key_found(prompts: list, completions: list, environments: list, **_: Any) -> list[float]:
    """TRL-style reward (needs the instances: env.servers 0): 1 when the episode's last turn starts with
    its vault's key, which only the tool call told it."""
    return [
        float(said(c[-1:]).strip()[:1] == env.key if c else False)
        for c, env in zip(completions, environments, strict=True)
    ]


def calls_k(prompts: list, completions: list, **_: Any) -> list[float]:
    """Shaping: the share of the call `[k]` the episode's first turn starts with."""
    out = []
    for episode in completions:
        text, n = said(episode[:1] if isinstance(episode, list) else episode), 0
        while n < min(len(text), 3) and text[n] == "[k]"[n]:
            n += 1
        out.append(n / 3)
    return out


def answers_a_key(prompts: list, completions: list, **_: Any) -> list[float]:
    """Shaping: 1 when the turn after a tool result starts with one of the 10 keys (any of them: the
    right one is `key_found`'s), so that the answer position keeps trying keys while the copy is learned."""
    out = []
    for episode in completions:
        roles = [m.get("role") for m in episode] if isinstance(episode, list) else []
        after = episode[roles.index("tool") + 1 :] if "tool" in roles else []
        first = said(after[:1]).strip()[:1] if after else ""
        out.append(float(bool(first) and first in KEYS))
    return out
