"""A dedicated scorer rank: reference log-probs and reward-model scores for the policy ranks.

When `placement.reference` / `placement.reward` name device ids, those models live only in a scorer
rank on that device. Each generation step, every policy rank sends the scorer its sequences and gets
back the reference log-probs and/or reward-model scores (gather_object / scatter_object_list over a
gloo group of {the node's policy ranks, the scorer}). A policy rank sends `None` when it is done.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime


def request(rt: Runtime, payload: dict) -> dict:
    """Send `payload` to every scorer of this rank; merge their answers ({"ref_logprobs", "rm_scores"}) and
    the seconds each scorer worked on the round ({"scorer_busy": {scorer rank: seconds}})."""
    answer: dict = {"scorer_busy": {}}
    for scorer_rank, _, group in rt.scorers:
        dist.gather_object(payload, None, dst=scorer_rank, group=group)
        out = [None]
        dist.scatter_object_list(out, None, src=scorer_rank, group=group)
        answer["scorer_busy"][scorer_rank] = out[0].pop("busy_s", 0.0)
        answer.update(out[0])
    return answer


def stop(rt: Runtime) -> None:
    for scorer_rank, _, group in rt.scorers:
        dist.gather_object(None, None, dst=scorer_rank, group=group)
        dist.scatter_object_list([None], None, src=scorer_rank, group=group)


def serve(rt: Runtime, job: Job, log=print) -> None:
    """The scorer's loop: answer every policy rank until all of them say stop."""
    from gpufleet.rl.batch import GenerationBatch, logprobs_of
    from gpufleet.rl.parts import load_reference
    from gpufleet.rl.precision import autocast_for, reward_model_dtype
    from gpufleet.rl.rewards import RewardModel
    from gpufleet.usercode import call_reward

    _, roles, group = rt.scorers[0]
    used = job.roles_used()
    reference = None
    if "reference" in roles and used["reference"]:
        reference = load_reference(job, str(rt.device))
    reward_model = None
    if "reward" in roles and used["reward"]:
        reward_model = RewardModel(job.reward.model, rt.device, dtype=reward_model_dtype(job))
    autocast = autocast_for(job, rt.device)
    micro = job.train.micro_batch or job.train.per_device_batch
    members = dist.get_world_size(group)
    log(f"scorer rank {rt.rank} on {rt.device}: {', '.join(roles)}")
    while True:
        payloads: list = [None] * members
        dist.gather_object(None, payloads, dst=rt.rank, group=group)
        if all(p is None for p in payloads):
            dist.scatter_object_list([None], [{}] * members, src=rt.rank, group=group)
            return
        started = time.perf_counter()
        _apply_ref_mixes(reference, payloads)
        answers = []
        for p in payloads:
            if p is None:
                answers.append({})
                continue
            if p.get("want_reference"):
                state = reference.state_dict() if reference is not None else None
                answers.append({"reference_state": {k: v.cpu() for k, v in state.items()} if state else None})
                continue
            out: dict = {}
            if reference is not None:
                batch = GenerationBatch(
                    p["input_ids"].to(rt.device),
                    p["attention_mask"].to(rt.device),
                    torch.zeros(0),
                    torch.zeros(0),
                    None,
                    None,
                    p["completion_start"],
                )
                out["ref_logprobs"] = logprobs_of(
                    reference,
                    batch,
                    job.rollout.temperature,
                    micro,
                    autocast,
                    p["suppress_tokens"],
                    p["early"],
                ).cpu()
            if reward_model is not None:
                out["rm_scores"] = call_reward(reward_model, p["prompts"], p["completions"], None, {})
            answers.append(out)
        busy = time.perf_counter() - started  # this round's work (the wait for the next one is idle)
        answers = [a | {"busy_s": busy} for a in answers]
        dist.scatter_object_list([None], answers, src=rt.rank, group=group)


def _apply_ref_mixes(reference, payloads: list) -> None:
    """Reference syncs (TR-DPO) sent with this round, in order (every policy rank sends the same ones: the
    first payload's are applied)."""
    from gpufleet.rl.refsync import mix_into

    sent = [p for p in payloads if p is not None and p.get("ref_mixes")]
    if reference is None or not sent:
        return
    for mix in sent[0]["ref_mixes"]:
        if mix[0] == "state":  # a resumed run's saved reference
            reference.load_state_dict(mix[1])
        else:
            mix_into(reference, mix[1], mix[0])


def reference_state(rt: Runtime, ref_mixes: list) -> dict | None:
    """The scorer's (synced) reference weights, for a checkpoint, after the syncs not yet sent (`ref_mixes`,
    applied first); every policy rank calls this together."""
    return request(rt, {"want_reference": True, "ref_mixes": list(ref_mixes)}).get("reference_state")
