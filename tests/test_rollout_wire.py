"""The messages between a policy rank and its rollout rank as tensors (rl/rolloutwire.py), over a real
2-process gloo group: what one end sends is what the other gets, the sampling settings and a push's wire
description travel only when they changed, answers keep their log-probs' dtype, a flush carries a count."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpufleet.engine.rollout import Rollout, Sampling
from gpufleet.launch.torchrun import free_port
from gpufleet.rl.rolloutwire import (
    Answer,
    pack_answer,
    recv_answers,
    recv_request,
    send_answers,
    send_request,
)
from helpers import gloo_done, gloo_rank

SAMPLING = Sampling(eos_token_id=2, pad_token_id=0, temperature=0.7, suppress_tokens=(5,), min_new_tokens=1)
WIRE = [("w", "float32", 6), ("b", "bfloat16", 2)]


def _ask(prompts, seeds, sampling=SAMPLING, logprobs=True) -> dict:
    return {
        "prompt_ids": prompts,
        "seeds": seeds,
        "max_new_tokens": 9,
        "sampling": sampling,
        "logprobs": logprobs,
    }


REQUESTS = [
    {"ask": _ask([[7, 8, 9], [4]], [10**12 + 3, 5]), "version": 0, "push": WIRE},
    {"ask": _ask([[1], [2, 3]], [6, 7]), "version": 1, "push": WIRE},  # nothing new to say: no blob
    {"ask": _ask([[1, 2]], [8], Sampling(2, 0), logprobs=False), "version": 2, "push": None},
    {"ask": None, "version": 3, "push": None},  # past the run's end
    {"flush": True},
    None,  # stop
]


def _answer(version: int, dtype) -> Answer:
    rollout = Rollout(
        prompt_ids=torch.tensor([[0, 7, 8], [4, 5, 6]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[3, 2], [9, 0]]),
        completion_mask=torch.tensor([[1, 1], [1, 0]]),
        completion_lengths=torch.tensor([2, 1]),
        is_truncated=torch.tensor([False, True]),
    )
    lp = None if dtype is None else torch.tensor([[-0.5, -1.25], [-3.0, 0.0]], dtype=dtype)
    return Answer(rollout, lp, version)


ANSWERS = [[_answer(4, torch.float32)], [None], [_answer(5, torch.bfloat16), _answer(6, None)]]


def _worker(rank: int, port: int, out: str) -> None:
    gloo_rank(rank, port)
    group = dist.new_group([0, 1])
    if rank == 0:  # the policy rank
        said: dict = {}
        for request in REQUESTS:
            send_request(1, group, said, request)
        got = [recv_answers(1, group), recv_answers(1, group)]
        dist.send(torch.zeros(1), dst=1, group=group)
        got.append(recv_answers(1, group))
        torch.save(got, out)
    else:  # the rollout rank
        said = {}
        got = [recv_request(0, group, said) for _ in REQUESTS]
        send_answers(0, group, [pack_answer(a) for a in ANSWERS[0]])
        send_answers(0, group, [pack_answer(a) for a in ANSWERS[1]])
        dist.recv(torch.zeros(1), src=0, group=group)
        send_answers(0, group, [pack_answer(a) for a in ANSWERS[2]], flush=True)
        torch.save(got, out + ".requests")
    gloo_done()


def test_requests_and_answers_arrive_as_sent(tmp_path):
    out = str(tmp_path / "got.pt")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2)
    requests = torch.load(out + ".requests", weights_only=False)
    assert requests == REQUESTS
    answers = torch.load(out, weights_only=False)
    assert [len(a) for a in answers] == [1, 1, 2]
    for got, sent in zip([x for a in answers for x in a], [x for a in ANSWERS for x in a], strict=True):
        if sent is None:
            assert got is None
            continue
        assert got.version == sent.version
        for name in sent.rollout.__dataclass_fields__:
            a, b = getattr(got.rollout, name), getattr(sent.rollout, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        if sent.logprobs is None:
            assert got.logprobs is None
        else:
            assert got.logprobs.dtype == sent.logprobs.dtype and torch.equal(got.logprobs, sent.logprobs)


def test_what_did_not_change_is_not_sent_again(monkeypatch):
    """The request's blob (sampling settings, wire) is there only when something changed (the headers
    read where they are sent)."""
    from gpufleet.rl import rolloutwire

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(rolloutwire.dist, "send", lambda t, dst, group: sent.append(t.clone()))
    said: dict = {}
    blobs = []
    for request in REQUESTS[:3]:
        sent.clear()
        send_request(1, None, said, request)
        blobs.append(int(sent[0][7]))
    assert blobs[0] > 0 and blobs[1] == 0 and blobs[2] > 0  # the third request's sampling settings differ
