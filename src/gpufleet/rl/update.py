"""One optimizer step: loss, backward, clip, step.

`optimizer_step` accumulates gradients over micro-batches, each micro-batch's loss scaled by the *whole
step's* normaliser (rl/losses.py `Loss.normalizer`), so the gradient depends neither on
`train.micro_batch` nor on the number of ranks. The batch comes from rl/step.py's `generation_step`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from gpufleet.dist import Runtime, all_gather_rows, all_reduce_sum
from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.errors import UserError
from gpufleet.rl import sampler
from gpufleet.rl.batch import GenerationBatch, length_cut, pack_over
from gpufleet.rl.entropy import entropy_threshold, high_entropy_mask
from gpufleet.rl.parts import Parts
from gpufleet.rl.routeraux import StepRouter, step_router


@dataclass(frozen=True)
class EntropyGate:
    """What one optimizer step's micro-batches share about entropy (rl/entropy.py): the high-entropy
    threshold (None: every token is trained), the global count of trained tokens, the bonus coefficient."""

    threshold: float | None
    trained: int
    coef: float


def optimizer_step(p: Parts, batch: GenerationBatch, opt, autocast) -> dict[str, float]:
    """Accumulate over micro-batches with the step-wide normaliser; clip; step. Returns loss metrics."""
    rt, t = p.rt, p.job.train
    tokens = batch.num_tokens
    global_tokens = int(all_reduce_sum(rt, float(tokens)).item())
    normalizer = p.loss.normalizer(batch.input_ids.shape[0], tokens, global_tokens, rt.policy_size)
    totals = dict.fromkeys(("loss", "entropy"), 0.0)
    micro = t.micro_batch or t.per_device_batch
    with autocast():
        cut = length_cut(p.train_model, p.early)
    micro_batches = [mb for _, mb in batch.micro_batches(micro, cut)]
    with rt.clock.phase("backward"):  # forward + backward (DDP's gradient all-reduce overlaps it)
        gate = _entropy_gate(p, micro_batches, global_tokens, autocast)
        router = step_router(p, micro_batches, autocast)  # a MoE policy's load-balancing loss (or None)
        opt.zero_grad(set_to_none=True)
        for k, mb in enumerate(micro_batches):
            sync = k == len(micro_batches) - 1
            _accumulate(p, mb, sync, normalizer, global_tokens, totals, autocast, gate, router)
    with rt.clock.phase("optimizer"):
        grad_norm = _clip_gradients(p)
        opt.step()
    shares = totals.pop("_sampler", None)  # the IS weights' metrics, formed in the loss (rl/sampler.py)
    # Metrics: each micro-batch's share was taken of the global count, so a sum over ranks is the mean.
    for key in sorted(k for k in totals if k != "loss"):  # the same keys, in the same order, on every rank
        totals[key] = float(all_reduce_sum(rt, totals[key]))
    totals["loss"] = p.loss.global_loss(float(all_reduce_sum(rt, totals["loss"])), rt.policy_size)
    trained_entropy = totals.pop("_trained_entropy", None)
    if trained_entropy is not None:  # the bonus was on: TRL's loss includes it, policy_loss does not
        totals["policy_loss"] = totals["loss"]
        totals["loss"] -= gate.coef * trained_entropy
        p.entropy.update(trained_entropy)
        totals["entropy_coef"] = p.entropy.coef
    totals["grad_norm"] = float(grad_norm)
    if shares is not None:
        totals |= sampler.metrics(rt, shares)
    return totals


def _entropy_gate(
    p: Parts, micro_batches: list[GenerationBatch], global_tokens: int, autocast
) -> EntropyGate:
    """The step's high-entropy threshold over every rank's valid tokens (a no-grad forward of the step's
    micro-batches first, only when algorithm.top_entropy_quantile < 1) and the bonus coefficient."""
    q = p.job.algorithm.top_entropy_quantile
    coef = p.entropy.applied()
    if q >= 1.0:
        return EntropyGate(None, global_tokens, coef)
    local = []
    with torch.no_grad(), autocast():
        for mb in micro_batches:
            _, entropy = _forward(p, mb)
            local.append(entropy.float()[mb.completion_mask.bool()])
    values = _gather_values(p.rt, torch.cat(local))
    threshold = entropy_threshold(values, q)
    return EntropyGate(threshold, int((values >= threshold).sum()), coef)


def _gather_values(rt: Runtime, local: torch.Tensor) -> torch.Tensor:
    """Every policy rank's 1-D `local` values, concatenated (ranks may hold different counts)."""
    counts = [int(c) for c in torch.cat(all_gather_rows(rt, torch.tensor([local.numel()])))]
    padded = torch.cat([local, local.new_zeros(max(counts) - local.numel())])
    return torch.cat([x[:n] for x, n in zip(all_gather_rows(rt, padded), counts, strict=True)])


def _forward(p: Parts, mb: GenerationBatch, router: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of a micro-batch under the trained policy (`router`: a list that
    gets a Mixture-of-Experts policy's router logits)."""
    return sequence_logprobs(
        p.train_model,
        mb.input_ids,
        mb.attention_mask,
        mb.completion_start,
        temperature=p.job.rollout.temperature,
        suppress_tokens=p.suppress_tokens,
        eos_token_id=p.early[0],
        min_new_tokens=p.early[1],
        pack_over=pack_over(p.train_model),
        router=router,
    )


def _accumulate(
    p: Parts,
    mb: GenerationBatch,
    sync: bool,
    normalizer: float,
    global_tokens: int,
    totals: dict,
    autocast,
    gate: EntropyGate,
    router: StepRouter | None = None,
) -> None:
    """Forward and backward of one micro-batch; add its share of the step's metrics to `totals`."""
    ranks = p.rt.policy_size
    logits = [] if router is not None else None
    with no_sync(p.train_model, sync), autocast():
        logp, entropy = _forward(p, mb, logits)
        logp, entropy = logp.float(), entropy.float()
        if mb.sampling_logprobs is not None:  # a rollout rank's batch used once: its IS weights from logp
            totals.setdefault("_sampler", []).append(sampler.in_loss(p, logp, mb))
        trained = (
            None if gate.threshold is None else high_entropy_mask(entropy, mb.completion_mask, gate.threshold)
        )
        loss, stats = p.loss(logp, mb, normalizer, trained)
        if not torch.isfinite(loss):
            bad = (~torch.isfinite(logp) & mb.completion_mask.bool()).any(dim=1).nonzero()
            row = int(bad[0]) if len(bad) else 0
            raise UserError(
                f"the loss is {loss.item()} (non-finite) in a micro-batch; first bad row {row}.",
                field="train.learning_rate",
                fix="lower train.learning_rate, use train.precision=fp32, or set train.max_grad_norm=1.0",
            )
        total = loss * p.loss.rank_scale(ranks)
        if p.entropy.enabled:  # the bonus: mean entropy of the trained tokens of the whole step
            on = mb.completion_mask if trained is None else mb.completion_mask * trained
            bonus = (entropy * on).sum() / max(gate.trained, 1)
            total = (
                total - gate.coef * bonus * ranks
            )  # DDP averages over ranks: x ranks gives the global mean
            totals["_trained_entropy"] = totals.get("_trained_entropy", 0.0) + bonus.item()
        if router is not None:  # the step's load-balancing loss, a share a micro-batch (rl/routeraux.py)
            added, aux = router.loss(logits[0], mb.attention_mask, ranks)
            total = total + added
            totals["aux_loss"] = totals.get("aux_loss", 0.0) + aux
        total.backward()
    share = mb.num_tokens / max(global_tokens, 1)
    row_share = mb.input_ids.shape[0] / (p.job.train.per_device_batch * ranks)
    totals["loss"] += loss.item()
    for key, value in stats.items():  # token means weighted by tokens, sequence means by rows (as TRL)
        totals[key] = totals.get(key, 0.0) + value * (row_share if p.loss.by_rows(key) else share)
    with torch.no_grad():
        totals["entropy"] += float((entropy * mb.completion_mask).sum()) / max(global_tokens, 1)


def _clip_gradients(p: Parts) -> torch.Tensor:
    """Clip to `train.max_grad_norm` (0: no clipping); the total norm, refused when not finite."""
    max_norm = p.job.train.max_grad_norm if p.job.train.max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(p.train_model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        raise UserError(
            f"the gradient norm is {grad_norm.item()} (non-finite).",
            field="train.learning_rate",
            fix="lower train.learning_rate or use train.precision=fp32",
        )
    return grad_norm


def no_sync(model, sync: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch."""
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
