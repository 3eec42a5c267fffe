"""The messages between a policy rank and its rollout rank as tensors (rl/rolloutwire.py), over a real
2-process gloo group: what one end sends is what the other gets (a long request in two messages, answers
with and without sampling log-probs, nothing past the run's end, the goodbye after a stop), and the sampling
settings and a push's wire description travel only when they changed."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpufleet.engine.rollout import Rollout, Sampling, left_pad
from gpufleet.launch.torchrun import free_port
from gpufleet.rl.rolloutwire import Answer, PolicyEnd, pack_answer, recv_request, send_answer, send_stop
from helpers import gloo_done, gloo_rank

SAMPLING = Sampling(eos_token_id=2, pad_token_id=0, temperature=0.7, suppress_tokens=(5,), min_new_tokens=1)
WIRE = [("w", "float32", 6), ("b", "bfloat16", 2)]
LONG = [[3 + i % 7] * (1 + i % 20) for i in range(300)]  # more than one message's worth of prompts


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
    {"ask": _ask(LONG, list(range(300)), Sampling(2, 0)), "version": 3, "push": None},
    {"ask": None, "version": 4, "push": None},  # past the run's end
    {"flush": True},
    None,  # stop
]


def _answer(request: dict) -> Answer | None:
    """What a rollout rank could answer to `request`: completions shorter than max_new_tokens."""
    ask = request["ask"]
    if ask is None:
        return None
    n = len(ask["prompt_ids"])
    ids, mask = left_pad(ask["prompt_ids"], 0)
    T = ask["max_new_tokens"] - 2
    g = torch.Generator().manual_seed(n)
    cmask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (n, 1), generator=g)).long()
    rollout = Rollout(
        ids, mask, torch.randint(3, 50, (n, T), generator=g) * cmask, cmask, cmask.sum(1), cmask.sum(1) == T
    )
    lp = -torch.rand(n, T, generator=g) if ask["logprobs"] else None
    return Answer(rollout, lp, request["version"])


ANSWERS = [_answer(r) for r in REQUESTS[:5]]


def _worker(rank: int, port: int, out: str) -> None:
    gloo_rank(rank, port)
    group = dist.new_group([0, 1])
    if rank == 0:  # the policy rank
        end = PolicyEnd(1, group)
        for request in REQUESTS:
            end.request(request)
        torch.save([end.answer() for _ in range(len(ANSWERS) + 1)], out)
    else:  # the rollout rank
        said: dict = {}
        got = [recv_request(0, group, said) for _ in REQUESTS]
        for request, answer in zip(REQUESTS, ANSWERS, strict=False):
            send_answer(0, group, pack_answer(answer, request["ask"] and request["ask"]["max_new_tokens"]))
        send_stop(0, group)
        torch.save(got, out + ".requests")
    gloo_done()


def test_requests_and_answers_arrive_as_sent(tmp_path):
    out = str(tmp_path / "got.pt")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2)
    assert torch.load(out + ".requests", weights_only=False) == REQUESTS
    answers = torch.load(out, weights_only=False)
    assert answers[-1] is None  # the goodbye
    for got, sent in zip(answers, ANSWERS, strict=False):
        if sent is None:
            assert got is None
            continue
        assert got.version == sent.version
        for name in sent.rollout.__dataclass_fields__:
            a, b = getattr(got.rollout, name), getattr(sent.rollout, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
        assert (got.logprobs is None) == (sent.logprobs is None)
        if sent.logprobs is not None:
            assert got.logprobs.dtype == sent.logprobs.dtype and torch.equal(got.logprobs, sent.logprobs)


def test_what_did_not_change_is_not_sent_again(monkeypatch):
    """A request is one message, with the blob (sampling settings, wire) only when something changed (the
    headers read where they are sent); a long one takes a second message."""
    from gpufleet.rl import rolloutwire

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(rolloutwire.dist, "send", lambda t, dst, group: sent.append(t.clone()))
    end = PolicyEnd(1, None)
    blobs, messages = [], []
    for request in REQUESTS[:4]:
        sent.clear()
        end.request(request)
        blobs.append(int(sent[0][7]))
        messages.append(len(sent))
    assert blobs[0] > 0 and blobs[1] == 0 and blobs[2] > 0 and blobs[3] == 0  # the third's sampling differs
    assert messages == [1, 1, 1, 2]
