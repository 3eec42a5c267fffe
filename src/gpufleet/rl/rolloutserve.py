"""The rollout rank's side of rl/rollouts.py: load the policy in the rollout dtype, then answer the policy
ranks it serves until they all say stop: receive each push into the weights in place, sample each request's
rows of every rank at once (single-turn rows: `Sampling.generate`, with the sampling log-probs when asked
for), or play an env job's (or tools on a data set's) episodes to their end (rl/rolloutplay.py), keep up to `rollout.async_steps`
answers ahead, and send every answer in flight on a checkpoint's flush.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime
from gpufleet.engine.rollout import Rollout, Sampling
from gpufleet.rl import rolloutplay
from gpufleet.rl.rollouts import buckets
from gpufleet.rl.rolloutwire import Answer, pack_answer, recv_request, send_answer, send_stop
from gpufleet.rl.tooldata import tools_on_data


def serve(rt: Runtime, job: Job, log=print) -> None:
    """The rollout rank's loop: sample for the policy ranks it serves until all of them say stop."""
    rank, group, weights_group = rt.rollouts[0]
    model = _load(job, rt.device)
    plays = job.env.name or tools_on_data(job)
    player = rolloutplay.player(job, rt, model) if plays else None  # plays whole episodes
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
            rolloutplay.close(player)
            return
        if asks[0].get("flush"):
            for item in queue:
                item[1] = item[1] or _answer(model, job, item[0], player)
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
            answers = oldest[1] or _answer(model, job, oldest[0], player)
            for dst, packed in zip(served, answers, strict=True):
                send_answer(dst, group, packed)
        if queue and queue[-1][1] is None:
            queue[-1][1] = _answer(model, job, queue[-1][0], player)


def _answer(model: torch.nn.Module, job: Job, asks: list[dict], player=None) -> list:
    """Every rank's rows sampled at once (and their sampling log-probs), cut back into each rank's rows,
    packed to be sent (rl/rolloutwire.py); an env job's episodes played to their end (rl/rolloutplay.py)."""
    if asks[0]["ask"] is None:  # past the run's end: nothing to sample
        return [pack_answer(None) for _ in asks]
    if asks[0]["ask"].get("play"):
        return rolloutplay.answer(player, asks)
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
