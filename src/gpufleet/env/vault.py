"""`builtin:vault` -- a task whose answer is only reachable through a tool call (env.format: chat).

Each episode shows a vault number (0-9, written SHOWN times); its key is a letter only the tool `k` knows
(the 10 vaults have 10 different keys, drawn once from a-z: nothing in the prompt tells them apart, and
one letter written every time is right 1 time in 10); the tool says it SAID times:

    tools: k(n)                   <- the chat template offers the tool (rollout.tools: [gpufleet.env.vault:k])
    U:77777777:                   <- observation: the vault number
    A:[k n=7]                     <- turn 1 (policy): the tool call
    T:qqqqqqqq                    <- the tool's answer (spliced by the template, not trained)
    A:q                           <- turn 2 (policy): the answer, checked by the environment

The environment sees only turns without tool calls: the first such turn is the answer (reward 1 when
its first character is the key, `success`), and ends the episode. Three shaping reward functions for the
job's reward.functions show a randomly initialised model the way:

- `call_shape`: the share of the right call (`[k n=7]`) the first turn starts with, so that the call's
  form is found character by character; a wrong digit counts half and ends the match. (With the prefix
  alone, each of 3 seeds learned `[k n` or `[k n=` in ~150 steps and then wrote `n`, `=` or ` ` again
  where the digit goes -- `[k n=n=`, `[k nnnn` --: the calls never parsed, every episode of a group
  earned the same, and GRPO had no signal left.)
- `right_vault`: the first turn starts `[k n=7` for vault 7: the digit copied from the prompt. (Paid only
  through the key, the digit collapsed onto one value for every vault before answers read the tool, and
  no group had a spread left to learn the copy from: 0 of 5 runs.)
- `reads_result`: the turn after the tool's answer starts with that answer's first character. (Without
  it a run wrote the call again as its answer.)

Why this shape: a random-init character model writes a given character about 1 time in 87, and the call
must be found one character at a time (measured: about 25 steps per character with 256 episodes a step);
the short tool name and the one-digit number keep it to 7 characters. A copy is learned when what is
copied fills the context: the digit shown once and the key said once were copied by no run in 600-1,000
steps; written 8 times each (a quarter of the context), both were (docs/agents-with-tools.md). (Two-digit
numbers and the tool `key` -- `[key n=41]`, 10 characters and two copies -- were not learned in 600 steps
of 64 episodes. Crediting each position on its own instead of the prefix collapsed a run onto
`[k========`: `=` is right at one position, and was then written at all of them.)
"""

from __future__ import annotations

import random
import string
from typing import Any

from gpufleet.models.builtin import CHAR_VOCAB, EOS_TOKEN_ID

VAULTS = 10
KEYS = random.Random("vault").sample(string.ascii_lowercase, VAULTS)
"""The key of vault n is KEYS[n]: 10 different letters."""

SHOWN = 8
"""How many times the observation writes the vault number (`77777777:`)."""

SAID = 8
"""How many times the tools say the key (`T:qqqqqqqq`): for a random-init character model, a letter that
fills a quarter of the context is a copy learned in minutes; said once, 3 seeds did not learn it with the
entropy bonus and the KL on, and 1 of 3 did without them (docs/agents-with-tools.md)."""


def k(n: int) -> str:
    """The key of vault n.

    Args:
        n: The vault number.
    """
    if not 0 <= int(n) < VAULTS:
        raise ValueError(f"no vault {n}")
    return KEYS[int(n)] * SAID


class VaultEnv:
    """`builtin:vault`: a vault number per episode; the answer is its key (the tool `k` knows it)."""

    instructions = ""

    def __init__(self):
        self._n: int | None = None

    def reset(self, *, seed: int, options: Any = None) -> tuple[str, dict]:
        self._n = random.Random(f"vault:{seed}").randrange(VAULTS)
        return f"{str(self._n) * SHOWN}:", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._n is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        right = action.strip()[:1] == KEYS[self._n]
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
    """The vault digit the prompt shows (text `77777777:` or `7:`, or the last message's content; the
    observation ends the prompt, after any env.instructions)."""
    text = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    return text.strip().rstrip(":")[-1:]


def _transcripts(completions: list, completion_ids: list[list[int]] | None) -> list[str]:
    """Each episode as sampled, from its first turn on (`completion_ids` through `sampled`, when given
    and of the built-in tokenizer), else as `said` renders it. Only a prefix as long as the call counts."""
    if completion_ids is not None and all(0 <= i < len(CHAR_VOCAB) for ids in completion_ids for i in ids):
        return [sampled(ids) for ids in completion_ids]
    return [said(c) for c in completions]


def sampled(ids: list[int]) -> str:
    """Token ids of the built-in character tokenizer as text, up to the first EOS: the first turn as the
    policy sampled it, and what followed when the turn was cut at its token limit without an EOS (a
    reward function's `completion_ids` hold the tool results and bridges too). The vault's rewards read it
    only when every id is in the built-in vocabulary; another tokenizer's ids cannot be read here (reward
    functions get no tokenizer), and they fall back to the parsed transcript (`said`)."""
    out = []
    for i in ids:
        if i == EOS_TOKEN_ID:
            break
        out.append(CHAR_VOCAB[i])
    return "".join(out)


def call_shape(
    prompts: list, completions: list, completion_ids: list[list[int]] | None = None, **_: Any
) -> list[float]:
    """Per episode: how much of the right call (`[k n=7]`) the first turn starts with, as a share of it; a
    wrong digit counts half and ends the match (`[k n=3]` for vault 7: 5.5 / 7, so that closing the call
    pays only once it names the right vault). The turn as sampled
    (`completion_ids`, when given), else as `said` renders the completion (text or TRL's message list).
    Not the parsed call: the built-in response template reads `[k=x` as a call to `k` and renders it
    `[k =x]`, which would credit `[k=` above `[k n` and hold a run there (measured: 3 of 3 runs stuck)."""
    out = []
    for prompt, completion in zip(prompts, _transcripts(completions, completion_ids), strict=True):
        target = f"[k n={_number(prompt)}]"
        score = 0.0
        for i, want in enumerate(target[: len(completion)]):
            got = completion[i]
            if got != want and not (want.isdigit() and got.isdigit()):
                break
            score += 1.0 if got == want else 0.5
            if got != want:  # a wrong digit: half, and nothing after it counts
                break
        out.append(score / len(target))
    return out


def right_vault(
    prompts: list, completions: list, completion_ids: list[list[int]] | None = None, **_: Any
) -> list[float]:
    """Per episode: 1 when the first turn starts `[k n=7` for vault 7 -- the call names the vault the
    prompt shows (as sampled: `completion_ids` when given, as call_shape)."""
    turns = _transcripts(completions, completion_ids)
    return [float(t.startswith(f"[k n={_number(p)}")) for p, t in zip(prompts, turns, strict=True)]


def reads_result(prompts: list, completions: list, **_: Any) -> list[float]:
    """Per episode: 1 when the turn after the first tool result starts with that result's first character
    (`...T:q\nA:q`): using what the tool said, right or wrong (the environment pays only the right key)."""
    out = []
    for episode in completions:
        _, tool, rest = said(episode).partition("T:")
        result, _, after = rest.partition("\nA:")
        out.append(float(bool(tool and result and after) and after[:1] == result[:1]))
    return out


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
