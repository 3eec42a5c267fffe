"""The plan's rows of dedicated rollout ranks (rl/rollouts.py) and what a weight push costs a policy rank.
Pure arithmetic, no torch import (plan/build.py puts the rows on their devices)."""

from __future__ import annotations

from dataclasses import replace

from gpufleet.config import precision
from gpufleet.config.load import Resolved
from gpufleet.hardware import Hardware
from gpufleet.plan.inference import (
    WEIGHT_BUCKET_BYTES,
    fast_decode_copies,
    logprob_scoring_bytes,
    rollout_bytes,
)
from gpufleet.plan.loads import ProcessLoad
from gpufleet.plan.memory import Precision
from gpufleet.plan.shape import Models, adapter_parameters
from gpufleet.rl.tooldata import tools_on_data
from gpufleet.topology import Topology


def rollout_process(
    k: int,
    r: Resolved,
    hw: Hardware,
    topo: Topology,
    models: Models,
    overhead: int,
    batch_tensors: int,
    micro: int,
) -> ProcessLoad:
    """Dedicated rollout rank `k` of a node (rl/rollouts.py): the policy in the compute dtype
    (config/precision.py `rollout_dtype`), the rows of the policy ranks it serves sampled at once, one weight bucket
    being received, and the batches it sends back."""
    job, pol = r.job, models.policy
    t = job.train
    served = len(range(k, len(topo.policy_devices), len(topo.rollout_devices)))
    rows = served * t.per_device_batch * t.steps_per_generation
    dtype = precision.rollout_dtype(job)
    infer = Precision(dtype, dtype)
    copies = fast_decode_copies(pol.arch, infer, wrapped=False, cpu=hw.is_cpu)
    roll = rollout_bytes(
        pol.arch,
        infer,
        sequences=rows,
        prompt_tokens=job.rollout.max_prompt_length,
        completion_tokens=job.completion_tokens(),
        weight_copies=copies,
    )
    weights = pol.params.total * infer.weight_bytes
    bucket = push_bucket(r, models)
    # the answers it holds: one per batch ahead and the one being sampled
    sent = served * batch_tensors * (job.rollout.async_steps + 1)
    scoring = 0  # the sampling log-probs are recorded while decoding; greedy single-turn rows take a
    # no-grad pass over the completions after it (rl/rolloutserve.py), where they are asked for
    if _logprob_pass(job):
        sizes = {"batch": micro, "prompt_tokens": job.rollout.max_prompt_length}
        sizes |= {"completion_tokens": job.completion_tokens(), "fused_logprobs": True}
        scoring = logprob_scoring_bytes(pol.arch, pol.params, infer, cached_weight_copies=False, **sizes)
    detail = {"policy_weights": weights, "weight_bucket": bucket, "kv_cache": roll["kv_cache"]}
    detail |= {"prefill": roll["prefill"], "sampling": roll["sampling"], "overhead": overhead}
    detail |= {"decoder_weight_copies": roll["decoder_weight_copies"], "batch_tensors": sent}
    detail |= {"sampling_logprobs": scoring}
    return ProcessLoad(
        role=f"rollout rank {k}",
        weights=weights,
        grads=0,
        optimizer=0,
        other=overhead + sent + bucket,
        phases={"rollout": roll["peak"], "scoring": scoring},
        detail=detail,
    )


def _logprob_pass(job) -> bool:
    """Whether the rollout rank may run a forward for the sampling log-probs: with the correction, greedy
    single-turn rows (sampling records them while decoding; the turns of env and tool episodes record them
    or go without)."""
    single_turn = not (job.env.name or tools_on_data(job))
    return job.algorithm.importance_sampling_correction and job.rollout.temperature == 0 and single_turn


def push_bucket(r: Resolved, models: Models) -> int:
    """The largest bucket of a weight push in the dtype it travels in (rl/rollouts.py `buckets`): 64 MiB,
    or a larger tensor alone (the embedding); LoRA's adapters in fp32."""
    job, arch = r.job, models.policy.arch
    adapter = adapter_parameters(job, arch)
    if adapter is not None:
        return min(WEIGHT_BUCKET_BYTES, adapter * 4)
    wire = Precision(precision.rollout_dtype(job), precision.rollout_dtype(job)).weight_bytes
    whole = models.policy.params.total * wire
    return max(min(WEIGHT_BUCKET_BYTES, whole), arch.vocab_size * arch.hidden_size * wire)


def pushing(load: ProcessLoad, r: Resolved, models: Models, fsdp: bool) -> ProcessLoad:
    """A policy rank that pushes its weights to a rollout rank: a bucket converted and flattened (two in
    the wire dtype), under FSDP first gathered whole in the weights' dtype."""
    bucket = push_bucket(r, models)
    wire = Precision(precision.rollout_dtype(r.job), precision.rollout_dtype(r.job)).weight_bytes
    gathered = (
        bucket // wire * Precision(precision.weights_dtype(r.job), "float32").weight_bytes if fsdp else 0
    )
    push = 2 * bucket + gathered
    return replace(load, other=load.other + push, detail=load.detail | {"weight_push": push})
