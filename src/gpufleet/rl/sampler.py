"""The trainer's side of a rollout rank's batch (rl/rollouts.py): whether its sampler can differ from the
trainer, its staleness, and the truncated importance weights against the trainer's log-probs with TRL's
metrics (the arithmetic is rl/offpolicy.py's)."""

from __future__ import annotations

import torch

from gpufleet.dist import all_gather_objects
from gpufleet.rl import offpolicy
from gpufleet.rl.batch import GenerationBatch, logprobs_of


def differs(job) -> bool:
    """Whether a rollout rank's samples can differ from what the trainer would sample: generated ahead, or
    in another precision. Lock-step in fp32 the rollout rank holds the trainer's weights exactly and the
    ratio is 1 (tested): no log-prob pass on either side."""
    from gpufleet.config import precision

    fp32 = precision.compute_dtype(job) == precision.rollout_dtype(job) == "float32"
    return job.rollout.async_steps > 0 or not fp32


def weigh(p, batch: GenerationBatch, answer, autocast) -> dict[str, float]:
    """A rollout rank's batch: its staleness, and with algorithm.importance_sampling_correction the
    truncated importance weights against the trainer's log-probs (rl/offpolicy.py) and TRL's metrics."""
    stats = {"rollout/staleness": float(p.remote.version - answer.version)}
    a = p.job.algorithm
    if answer.logprobs is None or not a.importance_sampling_correction:
        return stats
    old = batch.old_logprobs
    if old is None or dropout(p.train_model):  # the trainer's log-probs without dropout (LoRA's): as sampled
        t, ro, model = p.job.train, p.job.rollout, p.train_model
        micro = t.micro_batch or t.per_device_batch
        was = model.training
        model.eval()
        try:
            old = logprobs_of(model, batch, ro.temperature, micro, autocast, p.suppress_tokens, p.early)
        finally:
            model.train(was)
    sampling = answer.logprobs.to(old.device)
    mask = batch.completion_mask
    weights, ratios = offpolicy.sampler_weights(
        old,
        sampling,
        mask,
        a.importance_sampling_mode,
        a.importance_sampling_clip_min,
        a.importance_sampling_clip_max,
    )
    batch.sampler_weights = weights
    parts = all_gather_objects(p.rt, offpolicy.sampler_stats(old, sampling, mask, ratios))
    return stats | offpolicy.combine(parts)


def dropout(model: torch.nn.Module) -> bool:
    """Whether `model` drops anything in training mode (then its training-mode log-probs are noisy)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
