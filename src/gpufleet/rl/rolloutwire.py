"""The messages between a policy rank and its rollout rank (rl/rollouts.py), as int64 tensors sent point to
point over their (gloo) group: as a rule one message each way per request.
gather_object / scatter_object_list pickled every request and answer and sent each as two collectives (the
sizes, then the bytes): on the 2-core benchmark a few ms a step on the policy rank's critical path
(bench/async_rollout.py), where every message is a wake-up of a process that waits. What rarely changes
(the sampling settings, a push's wire description) travels pickled, only when it changed (both ends keep
what was said).

A request (policy -> rollout): `INLINE` int64s: the header [kind, version, push, rows, width,
max_new_tokens, logprobs, blob bytes], then for an ask its rows (rows, 2 + width: seed, prompt length, the
prompt's ids right-padded with 0), then the blob (a pickled {"sampling" | "wire": value} of what changed,
in int64s); what does not fit follows in a second message.

An answer (rollout -> policy): the header [kind, rows, prompt width P, completion width T, version], then
(rows, 2P + 2M + 2): prompt ids and mask, completion ids and mask (padded to M = the request's
max_new_tokens), length, truncated; then, when asked for, the sampling log-probs (rows, M) as float64 bits.
The policy rank knows its size from its request (`PolicyEnd`), so it is one message.

An env job's (or tools on a data set's) request (`"play"`: rl/rolloutplay.py) has the kind PLAY and rows
(seed, 3, episode row, group position, generation batch): the rollout rank plays those episodes to their end. Its answer is two
messages (the size of finished episodes is not known in advance): the header [PLAYED, rows, P, T, version,
blob bytes, log-probs, count columns], then the body: the rollout block as above (T wide), the loss mask
(rows, T), the env rewards (rows) as float64 bits, the sampling log-probs (rows, T) when asked for, the
per-episode counts (rows, K), and a pickled blob of the texts (prompts, transcripts, segments, ...) and the
counts' names.
"""

from __future__ import annotations

import math
import pickle
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpufleet.engine.rollout import Rollout

HEADER = 8
INLINE = 4096
"""int64s in a request's first message: its header and, as a rule, all of it (16 prompts of 250 tokens)."""
STOP, ASK, NOTHING, FLUSH, PLAY, PLAYED = 0, 1, 2, 3, 4, 5


@dataclass
class Answer:
    """A rollout rank's rows for one policy rank: the completions, their sampling log-probs (None when
    not asked for) and the policy's version (optimizer steps) of the weights that sampled them."""

    rollout: Rollout
    logprobs: torch.Tensor | None
    version: int
    played: dict | None = None
    """An env job's episodes (rl/rolloutplay.py): loss_mask, env_rewards, counts (tensors) and `rest`
    (the texts and other per-episode lists, pickled), seconds (the rollout rank's in env and tool calls
    playing them); None for single-turn rows."""


@dataclass
class PolicyEnd:
    """A policy rank's end of the wire to its rollout rank (global rank `dst`): what it told it, and the
    shape of each answer still to come, oldest first."""

    dst: int
    group: object
    said: dict = field(default_factory=dict)
    expect: deque = field(default_factory=deque)

    def request(self, request: dict | None) -> None:
        """Send rollouts.py's request: {"ask", "version", "push"}, {"flush": True} or None (stop)."""
        header = torch.zeros(HEADER, dtype=torch.long)
        parts = [header]
        if request is None or request.get("flush"):
            header[0] = STOP if request is None else FLUSH
            if request is None:
                self.expect.append(None)  # the rollout rank's goodbye: a header
        else:
            ask, push = request["ask"], request["push"]
            changed = {} if push is None or self.said.get("wire") == push else {"wire": push}
            kind = NOTHING if ask is None else PLAY if ask.get("play") else ASK
            header[:3] = torch.tensor([kind, request["version"], int(push is not None)])
            if ask is not None:
                if self.said.get("sampling") != ask["sampling"]:
                    changed["sampling"] = ask["sampling"]
                rows = prompt_rows(ask["prompt_ids"], ask["seeds"])
                logprobs, new = bool(ask.get("logprobs")), ask["max_new_tokens"]
                header[3:7] = torch.tensor([rows.shape[0], rows.shape[1] - 2, new, int(logprobs)])
                parts.append(rows.flatten())
                shape = (rows.shape[0], int(rows[:, 1].max()), new, logprobs)
                self.expect.append(("play", rows.shape[0]) if kind == PLAY else shape)
            else:
                self.expect.append(None)
            if changed:
                blob = pickle.dumps(changed)
                header[7] = len(blob)
                parts.append(_blob(blob))
                self.said.update(changed)
        _send_inline(torch.cat(parts), self.dst, self.group)

    def answer(self) -> Answer | None:
        """The oldest answer still to come (None: nothing was sampled for it)."""
        expect = self.expect.popleft()
        if expect is not None and expect[0] == "play":
            return _recv_played(self.dst, self.group, expect[1])
        size = HEADER
        if expect is not None:
            rows, P, M, logprobs = expect
            size += rows * (2 * P + 2 * M + 2) + (rows * M if logprobs else 0)
        flat = torch.empty(size, dtype=torch.long)
        dist.recv(flat, src=self.dst, group=self.group)
        kind, rows, P, T, version = flat[:5].tolist()
        if kind != ASK:
            return None
        if (rows, P) != expect[:2]:
            raise RuntimeError(f"a rollout rank answered {rows} rows of prompts {P} wide, not {expect[:2]}")
        M = expect[2]
        body = flat[HEADER : HEADER + rows * (2 * P + 2 * M + 2)].view(rows, -1)
        rollout = _rollout_of(body, P, M, T)
        lp = None
        if expect[3]:
            lp = flat[HEADER + body.numel() :].view(torch.float64).view(rows, M)[:, :T].float()
        return Answer(rollout, lp, version)


def recv_request(src: int, group, said: dict) -> dict | None:
    """The request global rank `src` sent (`PolicyEnd.request`); `said`: what it told this end before."""
    first = torch.empty(INLINE, dtype=torch.long)
    dist.recv(first, src=src, group=group)
    kind, version, push, rows, width, max_new_tokens, logprobs, blob = first[:HEADER].tolist()
    if kind == STOP:
        return None
    if kind == FLUSH:
        return {"flush": True}
    data = rows * (2 + width) + math.ceil(blob / 8)
    flat = first[HEADER : HEADER + data]
    if HEADER + data > INLINE:
        rest = torch.empty(HEADER + data - INLINE, dtype=torch.long)
        dist.recv(rest, src=src, group=group)
        flat = torch.cat([flat, rest])
    if blob:
        said.update(pickle.loads(flat[rows * (2 + width) :].numpy().tobytes()[:blob]))
    ask = None
    if kind in (ASK, PLAY):
        t = flat[: rows * (2 + width)].view(rows, 2 + width)
        ids = t[:, 2:].tolist()
        ask = {
            "prompt_ids": [row[:n] for row, n in zip(ids, t[:, 1].tolist(), strict=True)],
            "seeds": t[:, 0].tolist(),
            "max_new_tokens": max_new_tokens,
            "sampling": said["sampling"],
            "logprobs": bool(logprobs),
        } | ({"play": True} if kind == PLAY else {})
    return {"ask": ask, "version": version, "push": said["wire"] if push else None}


def prompt_rows(prompt_ids: list[list[int]], seeds: list[int]) -> torch.Tensor:
    """(rows, 2 + width) int64: each row's seed, prompt length and ids, right-padded with 0."""
    width = max((len(r) for r in prompt_ids), default=0)
    flat = [
        v for s, r in zip(seeds, prompt_ids, strict=True) for v in (s, len(r), *r, *[0] * (width - len(r)))
    ]
    return torch.tensor(flat, dtype=torch.long).view(len(prompt_ids), 2 + width)


def pack_answer(answer: Answer | None, max_new_tokens: int = 0) -> torch.Tensor | list[torch.Tensor]:
    """An `Answer` (or None: nothing sampled) as the one message `send_answer` sends, its completions padded
    to `max_new_tokens` (the size the policy rank expects); made once it is sampled, not while the policy
    rank waits for it."""
    header = torch.zeros(HEADER, dtype=torch.long)
    if answer is None:
        header[0] = NOTHING
        return header
    if answer.played is not None:
        return _pack_played(answer)
    r, lp = answer.rollout, answer.logprobs
    rows, P, T = r.prompt_ids.shape[0], r.prompt_ids.shape[1], r.completion_ids.shape[1]
    pad = max_new_tokens - T
    header[:5] = torch.tensor([ASK, rows, P, T, answer.version])
    parts = [header, _rollout_block(r, pad).flatten()]
    if lp is not None:
        parts.append(_bits(torch.nn.functional.pad(lp.double(), (0, pad))))
    return torch.cat(parts)


def _rollout_block(r: Rollout, pad: int) -> torch.Tensor:
    """(rows, 2P + 2(T + pad) + 2) int64: prompt ids and mask, completion ids and mask, length, truncated."""
    return torch.cat(
        [
            r.prompt_ids,
            r.prompt_mask,
            torch.nn.functional.pad(r.completion_ids, (0, pad)),
            torch.nn.functional.pad(r.completion_mask, (0, pad)),
            r.completion_lengths[:, None],
            r.is_truncated[:, None],
        ],
        dim=1,
    ).long()


def _rollout_of(body: torch.Tensor, P: int, M: int, T: int) -> Rollout:
    """The `Rollout` of a `_rollout_block` (completions M wide, T of them kept)."""
    ids, mask, cids, cmask, length, cut = body.split([P, P, M, M, 1, 1], dim=1)
    return Rollout(
        ids.contiguous(),
        mask.contiguous(),
        cids[:, :T].contiguous(),
        cmask[:, :T].contiguous(),
        length.squeeze(1).contiguous(),
        cut.squeeze(1).bool(),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as the int64s of its float64 values, flat."""
    return t.double().contiguous().flatten().view(torch.long)


def _blob(data: bytes) -> torch.Tensor:
    """Bytes as int64s (zero-padded to a multiple of 8)."""
    return torch.frombuffer(bytearray(data.ljust(8 * math.ceil(len(data) / 8), b"\0")), dtype=torch.long)


def _pack_played(a: Answer) -> list[torch.Tensor]:
    """An env job's episodes as their two messages (see the module docstring)."""
    r, played, lp = a.rollout, a.played, a.logprobs
    rows, P, T = r.prompt_ids.shape[0], r.prompt_ids.shape[1], r.completion_ids.shape[1]
    names = sorted(played["counts"])
    blob = pickle.dumps({"rest": played["rest"], "counts": names, "seconds": played.get("seconds", 0.0)})
    parts = [
        _rollout_block(r, 0).flatten(),
        played["loss_mask"].long().flatten(),
        _bits(played["env_rewards"]),
    ]
    if lp is not None:
        parts.append(_bits(lp))
    if names:
        parts.append(_bits(torch.stack([played["counts"][k].double() for k in names], dim=1)))
    parts.append(_blob(blob))
    header = torch.tensor([PLAYED, rows, P, T, a.version, len(blob), int(lp is not None), len(names)])
    return [header, torch.cat(parts)]


def _recv_played(src: int, group, expect_rows: int) -> Answer | None:
    """An env job's answer (`_pack_played`), or None: nothing was played for it."""
    header = torch.empty(HEADER, dtype=torch.long)
    dist.recv(header, src=src, group=group)
    kind, rows, P, T, version, blob, has_lp, K = header.tolist()
    if kind != PLAYED:
        return None
    if rows != expect_rows:
        raise RuntimeError(f"a rollout rank answered {rows} episodes, not {expect_rows}")
    sizes = [rows * (2 * P + 2 * T + 2), rows * T, rows, rows * T * has_lp, rows * K, math.ceil(blob / 8)]
    flat = torch.empty(sum(sizes), dtype=torch.long)
    dist.recv(flat, src=src, group=group)
    block, mask, rewards, lp, counts, tail = flat.split(sizes)
    meta = pickle.loads(tail.numpy().tobytes()[:blob])
    columns = counts.view(torch.float64).view(rows, K).float()
    played = {
        "rest": meta["rest"],
        "seconds": meta["seconds"],
        "loss_mask": mask.view(rows, T).float(),
        "env_rewards": rewards.view(torch.float64).float(),
        "counts": {k: columns[:, i].contiguous() for i, k in enumerate(meta["counts"])},
    }
    logprobs = lp.view(torch.float64).view(rows, T).float() if has_lp else None
    return Answer(_rollout_of(block.view(rows, -1), P, T, T), logprobs, version, played)


def send_answer(dst: int, group, packed: torch.Tensor | list[torch.Tensor]) -> None:
    for message in packed if isinstance(packed, list) else [packed]:
        dist.send(message, dst=dst, group=group)


def send_stop(dst: int, group) -> None:
    """The rollout rank's goodbye to a policy rank that said stop."""
    send_answer(dst, group, torch.zeros(HEADER, dtype=torch.long))


def _send_inline(flat: torch.Tensor, dst: int, group) -> None:
    """`flat` as one `INLINE` message (zero-padded), and what does not fit in a second."""
    first = torch.zeros(INLINE, dtype=torch.long)
    first[: min(len(flat), INLINE)] = flat[:INLINE]
    dist.send(first, dst=dst, group=group)
    if len(flat) > INLINE:
        dist.send(flat[INLINE:].contiguous(), dst=dst, group=group)
