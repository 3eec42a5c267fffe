"""Dedicated rollout ranks: the policy ranks' rows sampled on devices of their own (`placement.rollout`).

A rollout rank holds a copy of the policy (in the compute dtype, config/precision.py `rollout_dtype`;
LoRA: the base and its adapters) and answers the policy ranks it serves (dist.py `_rollout_groups`), as a
scorer rank does with the arrows reversed: each policy rank sends its prompts, per-completion seeds and
the engine's sampling settings (tensors sent point to point over a gloo group: rl/rolloutwire.py); the
rollout rank samples every row at once through the engine (`Sampling.generate`) and sends each rank its
rows back, as `generate` would have returned them to that rank alone (`Rollout.rows`).

The weights follow the policy: after an optimizer step, the next request carries `push`, and the first
policy rank of the group broadcasts the trainable parameters (all of them; LoRA: the adapters only) in
flat buckets of `WEIGHT_BUCKET_BYTES` in the rollout dtype over a group of its own (NCCL on GPUs). Under
FSDP every policy rank gathers each bucket's shards first (`full_tensor`, a collective of the policy
ranks). Same seeds, same weights: the same completions as a colocated rollout (float noise aside, as
between rank counts), so a job gives the same result with or without rollout ranks.

Ahead (`rollout.async_steps` k > 0, `fetch`): the request for generation batch g + k goes out before
batch g is trained, so the rollout rank samples it meanwhile with the weights of then. Both ends keep the
same count of requests at the rollout rank and apply one rule: when a new request makes it k + 1, the
oldest answer is sent first (k = 0: the new one is sampled and sent at once). Each answer carries the
weights version it was sampled with and (algorithm.importance_sampling_correction) its sampling
log-probs (rl/offpolicy.py), recorded while decoding (`generate(..., logprobs=True)`; greedy decoding:
one no-grad forward after it). A checkpoint `flush`es the answers in flight to the policy ranks, which save
them: a resumed run trains on exactly the batches the first one would have.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime
from gpufleet.engine.rollout import Rollout, Sampling
from gpufleet.plan.inference import WEIGHT_BUCKET_BYTES
from gpufleet.rl.rolloutwire import Answer, PolicyEnd, pack_answer, recv_request, send_answer, send_stop

__all__ = ["Answer", "RemoteRollout", "connect", "fetch", "flush", "sample", "serve", "stop"]


@dataclass
class RemoteRollout:
    """A policy rank's way to its rollout rank, and which weights that rank holds."""

    rank: int
    group: object
    weights_group: object | None
    """The push's group (this rank pushes), or None (another policy rank pushes for the group)."""
    dtype: torch.dtype
    """What the rollout rank holds the policy in (a full model's push travels in it)."""
    device: torch.device = torch.device("cpu")
    """Where a push's buckets are made (this rank's device: NCCL sends from the GPU, offloaded shards too)."""
    version: int = 0
    """Optimizer steps taken by the policy (`stepped` after each one)."""
    pushed: int = -1
    """The version the rollout rank holds (-1: none yet: the first request pushes)."""
    sync_seconds: float = 0.0
    """Seconds spent pushing weights since the last `take_sync_seconds`."""
    ahead: int = 0
    """rollout.async_steps: generation batches requested beyond the one being trained."""
    sent: int = 0
    """The next generation batch to request (requests go out in order)."""
    waiting: int = 0
    """Requests at the rollout rank not answered yet (the rollout rank counts the same)."""
    held: dict[int, Answer] = field(default_factory=dict)
    """Answers received and not yet used, by generation batch."""
    wait_seconds: float = 0.0
    """Seconds spent waiting on the rollout rank (to take a request, for an answer) since the last
    `take_wait_seconds`."""
    link: PolicyEnd = field(init=False)
    """This end of the wire (rl/rolloutwire.py): what the rollout rank was told, the answers to come."""

    def __post_init__(self) -> None:
        self.link = PolicyEnd(self.rank, self.group)

    def stepped(self) -> None:
        self.version += 1

    def take_sync_seconds(self) -> float:
        seconds, self.sync_seconds = self.sync_seconds, 0.0
        return seconds

    def take_wait_seconds(self) -> float:
        seconds, self.wait_seconds = self.wait_seconds, 0.0
        return seconds


def connect(rt: Runtime, job: Job) -> RemoteRollout | None:
    """This policy rank's rollout rank, or None when it samples its own rows."""
    from gpufleet.config.precision import rollout_dtype

    if not rt.rollouts or rt.role != "policy":
        return None
    return RemoteRollout(
        *rt.rollouts[0],
        dtype=getattr(torch, rollout_dtype(job)),
        device=rt.device,
        ahead=job.rollout.async_steps,
    )


def sample(
    remote: RemoteRollout,
    policy: torch.nn.Module,
    sampling: Sampling,
    prompt_ids: list[list[int]],
    seeds: list[int],
    max_new_tokens: int,
) -> Rollout:
    """This rank's rows sampled by its rollout rank now, with the current weights (an env's turns: every
    policy rank calls this together)."""
    _request(
        remote,
        policy,
        {"prompt_ids": prompt_ids, "seeds": seeds, "max_new_tokens": max_new_tokens, "sampling": sampling},
    )
    key = remote.sent - 1
    while key not in remote.held:
        _receive_oldest(remote)
    return remote.held.pop(key).rollout


def fetch(
    remote: RemoteRollout, policy: torch.nn.Module, gen_index: int, request_of: Callable[[int], dict | None]
) -> Answer:
    """Generation batch `gen_index`'s rows, after requesting those up to gen_index + async_steps (each
    with the weights of now); `request_of(g)`: batch g's request, None past the run's end."""
    while remote.sent <= gen_index + remote.ahead:
        _request(remote, policy, request_of(remote.sent))
    while gen_index not in remote.held:
        _receive_oldest(remote)
    return remote.held.pop(gen_index)


def flush(remote: RemoteRollout | None) -> None:
    """Have every answer in flight sampled and sent here (before a checkpoint saves `remote.held`)."""
    if remote is None or not remote.waiting:
        return
    remote.link.request({"flush": True})
    first = remote.sent - remote.waiting
    remote.held.update({first + i: remote.link.answer() for i in range(remote.waiting)})
    remote.waiting = 0


def _request(remote: RemoteRollout, policy: torch.nn.Module, ask: dict | None) -> None:
    """Send the next request (None: nothing to sample, past the run's end), pushing the weights first if
    they changed; then, if the rollout rank now holds more than `ahead`, receive the oldest answer."""
    push = ask is not None and remote.version != remote.pushed
    payload = {
        "ask": ask,
        "version": remote.version,
        "push": wire(policy, remote.dtype) if push else None,
    }
    asked = time.perf_counter()
    remote.link.request(payload)  # waits for a busy rollout rank
    remote.wait_seconds += time.perf_counter() - asked
    if push:
        started = time.perf_counter()
        _push(policy, remote, payload["push"])
        if remote.device.type == "cuda":  # the broadcasts are queued: count them here, not in the next phase
            torch.cuda.synchronize(remote.device)
        remote.sync_seconds += time.perf_counter() - started
        remote.pushed = remote.version
    remote.sent += 1
    remote.waiting += 1
    if remote.waiting > remote.ahead:
        _receive_oldest(remote)


def _receive_oldest(remote: RemoteRollout) -> None:
    started = time.perf_counter()
    answer = remote.link.answer()
    remote.wait_seconds += time.perf_counter() - started
    remote.held[remote.sent - remote.waiting] = answer
    remote.waiting -= 1


def stop(remote: RemoteRollout | None) -> None:
    """Tell the rollout rank this policy rank is done (it returns when all of its ranks are)."""
    if remote is None:
        return
    remote.link.request(None)
    remote.link.answer()


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters a push carries, in order: those the optimizer changes (LoRA: the adapters)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def wire(policy: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, str, int]]:
    """What a push sends, in order: (name, dtype, elements) of each trainable parameter. A full model's
    parameters travel in the rollout dtype; LoRA's adapters in their own (peft keeps them in fp32 on a
    bf16 base, on both ends). Both ends cut the same buckets from this list."""
    peft = hasattr(policy, "peft_config")
    out = []
    for name, p in trainable(policy):
        travel = p.dtype if peft or not p.dtype.is_floating_point else dtype
        out.append((name, str(travel).removeprefix("torch."), p.numel()))
    return out


def buckets(items: list[tuple[str, str, int]], limit: int = WEIGHT_BUCKET_BYTES) -> list[range]:
    """Consecutive index ranges of `wire` items of one dtype each, at most `limit` bytes (a larger tensor
    alone); both ends of a push cut the same list the same way."""
    out, start, total = [], 0, 0
    for i, (_, dtype, numel) in enumerate(items):
        size = numel * getattr(torch, dtype).itemsize
        if i > start and (total + size > limit or dtype != items[start][1]):
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(items):
        out.append(range(start, len(items)))
    return out


def _push(policy: torch.nn.Module, remote: RemoteRollout, items: list[tuple[str, str, int]]) -> None:
    """Broadcast the trainable parameters bucket by bucket (gathering FSDP shards first, on every rank)."""
    params = [p for _, p in trainable(policy)]
    with torch.no_grad():
        for span in buckets(items):
            whole = [_whole(params[i]) for i in span]  # a collective of the policy ranks under FSDP
            if remote.weights_group is None:
                continue
            dtype = getattr(torch, items[span[0]][1])
            flat = _flatten_dense_tensors([t.to(device=remote.device, dtype=dtype) for t in whole])
            dist.broadcast(flat, src=dist.get_rank(), group=remote.weights_group)


def _whole(p: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter (an FSDP2 DTensor's shards gathered) without autograd."""
    from torch.distributed.tensor import DTensor

    t = p.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def serve(rt: Runtime, job: Job, log=print) -> None:
    """The rollout rank's loop: sample for the policy ranks it serves until all of them say stop."""
    rank, group, weights_group = rt.rollouts[0]
    model = _load(job, rt.device)
    params = dict(model.named_parameters())
    model.requires_grad_(False)
    served = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))][
        :-1
    ]  # then this rank
    said: list[dict] = [{} for _ in served]  # what each policy rank told this one (rl/rolloutwire.py)
    ahead = job.rollout.async_steps
    queue: deque = deque()  # [asks, packed answers or None] per request not yet answered, oldest first
    log(
        f"rollout rank {rt.rank} on {rt.device}: serving {len(served)} policy rank(s), {ahead} batch(es) ahead"
    )
    while True:
        asks = [recv_request(src, group, told) for src, told in zip(served, said, strict=True)]
        if all(a is None for a in asks):
            for dst in served:
                send_stop(dst, group)
            return
        if asks[0].get("flush"):
            for item in queue:
                item[1] = item[1] or _answer(model, job, item[0])
            for m, dst in enumerate(served):
                for item in queue:
                    send_answer(dst, group, item[1][m])
            queue.clear()
            continue
        if asks[0]["push"] is not None:
            _receive(params, asks[0]["push"], rank, weights_group)
        queue.append([asks, None])
        if len(queue) > ahead:  # the oldest answer goes first (sampled now if it is the new one)
            oldest = queue.popleft()
            answers = oldest[1] or _answer(model, job, oldest[0])
            for dst, packed in zip(served, answers, strict=True):
                send_answer(dst, group, packed)
        if queue and queue[-1][1] is None:
            queue[-1][1] = _answer(model, job, queue[-1][0])


def _answer(model: torch.nn.Module, job: Job, asks: list[dict]) -> list[torch.Tensor]:
    """Every rank's rows sampled at once (and their sampling log-probs), cut back into each rank's rows,
    packed to be sent (rl/rolloutwire.py)."""
    if asks[0]["ask"] is None:  # past the run's end: nothing to sample
        return [pack_answer(None) for _ in asks]
    first = asks[0]["ask"]
    prompts = [row for a in asks for row in a["ask"]["prompt_ids"]]
    seeds = [s for a in asks for s in a["ask"]["seeds"]]
    sampling: Sampling = first["sampling"]
    asked = bool(first.get("logprobs"))  # recorded while decoding (greedy: a forward after)
    out = sampling.generate(model, prompts, seeds, first["max_new_tokens"], logprobs=asked)
    logprobs = out.logprobs
    if asked and logprobs is None:
        logprobs = _sampling_logprobs(model, job, sampling, out)
    answers, start = [], 0
    for a in asks:
        stop = start + len(a["ask"]["prompt_ids"])
        rows = out.rows(start, stop)
        lp = None if logprobs is None else logprobs[start:stop, : rows.completion_ids.shape[1]].cpu()
        answers.append(pack_answer(Answer(rows.to("cpu"), lp, a["version"]), a["ask"]["max_new_tokens"]))
        start = stop
    return answers


def _sampling_logprobs(model: torch.nn.Module, job: Job, sampling: Sampling, out: Rollout) -> torch.Tensor:
    """The log-probs of the sampled tokens under the distribution they were sampled from (temperature,
    suppressed tokens, EOS held back): one no-grad pass of this rank's model over the completions (where
    the decode recorded none: greedy decoding)."""
    from contextlib import nullcontext

    from gpufleet.rl.batch import GenerationBatch, logprobs_of

    empty = torch.zeros(0)
    batch = GenerationBatch(out.input_ids, out.attention_mask, empty, empty, None, None, out.completion_start)
    micro = job.train.micro_batch or job.train.per_device_batch
    early = (sampling.eos_token_id, sampling.min_new_tokens)
    return logprobs_of(
        model, batch, sampling.temperature, micro, nullcontext, sampling.suppress_tokens, early
    )


def _receive(params: dict[str, torch.Tensor], items: list, rank: int, weights_group) -> None:
    """Copy a push into `params` in place (the fast decoder's and CUDA graphs' tensors stay valid): each
    bucket into one flat buffer in the dtype it travels in, then cast into the parameters."""
    src = next(r for r in dist.get_process_group_ranks(weights_group) if r != rank)
    device = next(iter(params.values())).device
    with torch.no_grad():
        for span in buckets(items):
            part = [params[items[i][0]] for i in span]
            flat = torch.empty(
                sum(items[i][2] for i in span), dtype=getattr(torch, items[span[0]][1]), device=device
            )
            dist.broadcast(flat, src=src, group=weights_group)
            for p, value in zip(part, _unflatten_dense_tensors(flat, part), strict=True):
                p.copy_(value)


def _load(job: Job, device: torch.device) -> torch.nn.Module:
    """The policy as the rollout rank holds it: model.path in the rollout dtype (LoRA: with fresh
    adapters); the first push brings the policy's current weights."""
    from gpufleet.config.precision import rollout_dtype
    from gpufleet.models import load_causal_lm

    model = load_causal_lm(job.model.path, dtype=rollout_dtype(job), device=str(device))
    if job.model.use_peft:
        from gpufleet.models import lora

        model = lora.apply(model, job.model)
    return model.eval()
