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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime
from gpufleet.plan.inference import WEIGHT_BUCKET_BYTES
from gpufleet.rl.rolloutwire import Answer, PolicyEnd

__all__ = ["Answer", "RemoteRollout", "connect", "fetch", "flush", "stop"]


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
    env_seconds: float = 0.0
    """An env job (or tools on a data set): seconds the rollout rank spent in env and tool calls playing the
    batches taken since the last `take_env_seconds` (rl/rolloutplay.py)."""
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

    def take_env_seconds(self) -> float:
        seconds, self.env_seconds = self.env_seconds, 0.0
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
