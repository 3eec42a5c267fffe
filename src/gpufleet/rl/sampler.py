"""The trainer's side of a rollout rank's batch (rl/rollouts.py): whether its sampler can differ from the
trainer, its staleness, and the truncated importance weights against the trainer's log-probs with TRL's
metrics (the arithmetic is rl/offpolicy.py's).

Which trainer log-probs: the old ones when the batch is reused (already computed); when it is used once
(`num_iterations` 1, one optimizer step per generation batch) the training forward's own, detached, as
the loss takes them for old log-probs then (TRL's `old = per_token_logps.detach()`): the weights are
formed per micro-batch inside the optimizer step (`in_loss`), with no pass of their own. Only a policy
with dropout takes a separate no-grad pass (its training-mode log-probs are noisy)."""

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
    if answer.logprobs is None or not p.job.algorithm.importance_sampling_correction:
        return stats
    old = batch.old_logprobs
    if old is None and not dropout(p.train_model):  # used once: from the training forward (`in_loss`)
        batch.sampling_logprobs = answer.logprobs.to(batch.completion_mask.device)
        return stats
    if old is None:  # the trainer's log-probs without dropout (LoRA's): as sampled
        t, ro, model = p.job.train, p.job.rollout, p.train_model
        micro = t.micro_batch or t.per_device_batch
        was = model.training
        model.eval()
        try:
            old = logprobs_of(model, batch, ro.temperature, micro, autocast, p.suppress_tokens, p.early)
        finally:
            model.train(was)
    return stats | metrics(p.rt, [_weights_into(p, batch, old, answer.logprobs)])


def dropout(model: torch.nn.Module) -> bool:
    """Whether `model` drops anything in training mode (then its training-mode log-probs are noisy)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def in_loss(p, logp: torch.Tensor, mb: GenerationBatch) -> dict:
    """A micro-batch's truncated importance weights from the training forward's log-probs `logp` (detached:
    the old log-probs of a batch used once), set as `mb.sampler_weights` before its loss; returns this
    micro-batch's share of TRL's metrics (`metrics` makes them whole)."""
    return _weights_into(p, mb, logp.detach(), mb.sampling_logprobs)


def metrics(rt, parts: list[dict]) -> dict[str, float]:
    """TRL's `sampling/*` metrics of one optimizer step from this rank's shares (one per micro-batch with
    `in_loss`), over every policy rank."""
    return offpolicy.combine([part for rank in all_gather_objects(rt, parts) for part in rank])


def _weights_into(p, batch: GenerationBatch, old: torch.Tensor, sampling: torch.Tensor) -> dict:
    """`batch.sampler_weights` from the trainer's (`old`) and the sampler's log-probs (rl/offpolicy.py,
    the job's mode and bounds); returns the batch's share of TRL's metrics."""
    a = p.job.algorithm
    sampling, mask = sampling.to(old.device), batch.completion_mask
    weights, ratios = offpolicy.sampler_weights(
        old,
        sampling,
        mask,
        a.importance_sampling_mode,
        a.importance_sampling_clip_min,
        a.importance_sampling_clip_max,
    )
    batch.sampler_weights = weights
    return offpolicy.sampler_stats(old, sampling, mask, ratios)
