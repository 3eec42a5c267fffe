"""The messages between a policy rank and its rollout rank (rl/rollouts.py), as tensors sent point to point
over their (gloo) group: a fixed-size header, then the rows. gather_object / scatter_object_list pickled
every request and answer and sent each as two collectives (the sizes, then the bytes); on the 2-core
benchmark that was several ms a step on the policy rank's critical path (bench/async_rollout.py). What
rarely changes (the sampling settings, a push's wire description) still travels pickled, and only when it
changed since the last request (both ends keep what was said).

A request (policy -> rollout): the header int64 [kind, version, push, rows, width, max_new_tokens,
logprobs, blob bytes]; the blob (uint8: a pickled {"sampling" | "wire": value} of what changed); for an
ask, its rows: int64 (rows, 2 + width): seed, prompt length, the prompt's ids (right-padded with 0).
`recv_request` gives back what rollouts.py sends: {"ask", "version", "push"}, {"flush": True} or None (stop).

An answer (rollout -> policy): the header int64 [kind, rows, prompt width P, completion width T, version,
logprobs, their dtype, count]; the rollout's rows int64 (rows, 2P + 2T + 2): prompt ids and mask, completion
ids and mask, length, truncated; the sampling log-probs (rows, T) when there are. A flush is a header with
the count of answers that follow.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpufleet.engine.rollout import Rollout

HEADER = 8
STOP, ASK, NOTHING, FLUSH = 0, 1, 2, 3
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class Answer:
    """A rollout rank's rows for one policy rank: the completions, their sampling log-probs (None when
    not asked for) and the policy's version (optimizer steps) of the weights that sampled them."""

    rollout: Rollout
    logprobs: torch.Tensor | None
    version: int


def send_request(dst: int, group, said: dict, request: dict | None) -> None:
    """Send `request` (rollouts.py's dict, or None: stop) to global rank `dst`; `said`: what this end
    told it before (updated)."""
    header = torch.zeros(HEADER, dtype=torch.long)
    tensors = []
    if request is None or request.get("flush"):
        header[0] = STOP if request is None else FLUSH
    else:
        ask, push = request["ask"], request["push"]
        header[:3] = torch.tensor(
            [NOTHING if ask is None else ASK, request["version"], int(push is not None)]
        )
        changed = {} if push is None or said.get("wire") == push else {"wire": push}
        if ask is not None:
            if said.get("sampling") != ask["sampling"]:
                changed["sampling"] = ask["sampling"]
            rows = prompt_rows(ask["prompt_ids"], ask["seeds"])
            header[3:7] = torch.tensor(
                [rows.shape[0], rows.shape[1] - 2, ask["max_new_tokens"], int(bool(ask.get("logprobs")))]
            )
        if changed:
            blob = torch.frombuffer(bytearray(pickle.dumps(changed)), dtype=torch.uint8)
            header[7] = blob.numel()
            tensors.append(blob)
            said.update(changed)
        if ask is not None:
            tensors.append(rows)
    for t in (header, *tensors):
        dist.send(t, dst=dst, group=group)


def recv_request(src: int, group, said: dict) -> dict | None:
    """The request global rank `src` sent (`send_request`); `said`: what it told this end before."""
    header = _recv(torch.empty(HEADER, dtype=torch.long), src, group)
    kind, version, push, rows, width, max_new_tokens, logprobs, blob = header.tolist()
    if kind == STOP:
        return None
    if kind == FLUSH:
        return {"flush": True}
    if blob:
        said.update(pickle.loads(_recv(torch.empty(blob, dtype=torch.uint8), src, group).numpy().tobytes()))
    ask = None
    if kind == ASK:
        t = _recv(torch.empty((rows, 2 + width), dtype=torch.long), src, group)
        ids = t[:, 2:].tolist()
        ask = {
            "prompt_ids": [row[:n] for row, n in zip(ids, t[:, 1].tolist(), strict=True)],
            "seeds": t[:, 0].tolist(),
            "max_new_tokens": max_new_tokens,
            "sampling": said["sampling"],
            "logprobs": bool(logprobs),
        }
    return {"ask": ask, "version": version, "push": said["wire"] if push else None}


def prompt_rows(prompt_ids: list[list[int]], seeds: list[int]) -> torch.Tensor:
    """(rows, 2 + width) int64: each row's seed, prompt length and ids, right-padded with 0."""
    width = max((len(r) for r in prompt_ids), default=0)
    flat = [
        v for s, r in zip(seeds, prompt_ids, strict=True) for v in (s, len(r), *r, *[0] * (width - len(r)))
    ]
    return torch.tensor(flat, dtype=torch.long).view(len(prompt_ids), 2 + width)


def pack_answer(answer: Answer | None) -> list[torch.Tensor]:
    """An `Answer` (or None: nothing sampled) as the tensors `send_answers` sends, made once it is sampled
    (not while the policy rank waits for it)."""
    header = torch.zeros(HEADER, dtype=torch.long)
    if answer is None:
        header[0] = NOTHING
        return [header]
    r, lp = answer.rollout, answer.logprobs
    P, T = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    parts = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    body = torch.cat([*parts, r.completion_lengths[:, None], r.is_truncated[:, None]], dim=1).long()
    code = 0 if lp is None else FLOATS.index(lp.dtype)
    header[:7] = torch.tensor([ASK, body.shape[0], P, T, answer.version, int(lp is not None), code])
    return [header, body] if lp is None else [header, body, lp.contiguous()]


def send_answers(dst: int, group, packed: list[list[torch.Tensor]], flush: bool = False) -> None:
    """Send `pack_answer`s to global rank `dst`: one, or with `flush` a count and then each."""
    if flush:
        header = torch.zeros(HEADER, dtype=torch.long)
        header[0], header[7] = FLUSH, len(packed)
        dist.send(header, dst=dst, group=group)
    elif len(packed) != 1:
        raise ValueError(f"one answer at a time outside a flush, got {len(packed)}")
    for tensors in packed:
        for t in tensors:
            dist.send(t, dst=dst, group=group)


def recv_answers(src: int, group) -> list[Answer | None]:
    """What `send_answers` sent from global rank `src`: [one answer (or None)], or a flush's answers."""
    header = _recv(torch.empty(HEADER, dtype=torch.long), src, group)
    if int(header[0]) != FLUSH:
        return [_recv_answer(header, src, group)]
    return [
        _recv_answer(_recv(torch.empty_like(header), src, group), src, group) for _ in range(int(header[7]))
    ]


def _recv_answer(header: torch.Tensor, src: int, group) -> Answer | None:
    kind, rows, P, T, version, logprobs, code, _ = header.tolist()
    if kind != ASK:
        return None
    body = _recv(torch.empty((rows, 2 * P + 2 * T + 2), dtype=torch.long), src, group)
    lp = _recv(torch.empty((rows, T), dtype=FLOATS[code]), src, group) if logprobs else None
    ids, mask, cids, cmask, length, cut = (x.contiguous() for x in body.split([P, P, T, T, 1, 1], dim=1))
    return Answer(Rollout(ids, mask, cids, cmask, length.squeeze(1), cut.squeeze(1).bool()), lp, version)


def _recv(t: torch.Tensor, src: int, group) -> torch.Tensor:
    dist.recv(t, src=src, group=group)
    return t
