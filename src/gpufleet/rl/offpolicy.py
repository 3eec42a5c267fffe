"""Truncated importance sampling of another sampler's completions (TRL's vLLM IS correction).

A dedicated rollout rank (rl/rollouts.py) samples with its own copy of the policy: in the compute dtype,
and with `rollout.async_steps` > 0 from weights k generation batches old. Its sampling log-probs come
with the completions; the trainer's log-probs of the same tokens under the weights it trains from
(`old`) give the per-token log-ratio log pi_old - log pi_sampler, and each completion's policy loss is
weighted by the truncated ratio (TRL's `_generate_and_score_completions`; `policy_loss`'s
`sampler_weights`), detached:

* `token_*`: one ratio per token, exp(old - sampling); `sequence_*`: one per completion, the exp of the
  *sum* of its tokens' log-ratios (TRL's choice; GSPO's sequence ratio uses the mean), shared by its tokens.
* `*_truncate`: the ratio clamped to [clip_min, clip_max]; `*_mask`: 0 outside them (a missing bound is
  no bound), the raw ratio inside.

Masked positions (padding, an env's tokens) have log-ratio 0. The weights multiply the policy term only,
before the KL is added, as TRL does.
"""

from __future__ import annotations

import math

import torch


def sampler_weights(
    old: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (B, T), the ratios TRL's metrics read: one per completion at sequence level, one per valid
    token at token level), for `old` and `sampling` log-probs (B, T) of the tokens `mask` marks."""
    valid = mask.bool()
    diff = torch.where(valid, old.detach().double() - sampling.double(), 0.0)
    sequence = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence else diff)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=lo, max=hi)
    elif mode.endswith("mask"):
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    else:
        raise ValueError(f"unknown importance sampling mode {mode!r}")
    seen = ratio.flatten() if sequence else ratio[valid]
    return ratio.expand(valid.shape).to(old.dtype).contiguous(), seen.float()


def sampler_stats(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, ratios: torch.Tensor
) -> dict:
    """This rank's share of TRL's `sampling/*` metrics (`combine` makes them whole over the ranks)."""
    gap = (old.detach().double() - sampling.double()).abs()[mask.bool()]
    r = ratios.double()
    return {
        "gap": (float(gap.sum()), gap.numel(), float(gap.max()) if gap.numel() else None),
        "ratio": (
            float(r.sum()),
            r.numel(),
            float(r.min()) if r.numel() else None,
            float(r.max()) if r.numel() else None,
        ),
    }


def combine(parts: list[dict]) -> dict[str, float]:
    """TRL's metrics from every rank's `sampler_stats`: the mean and max of |log pi_old - log pi_sampler|
    over the valid tokens, and the min / mean / max of the ratios (means over all of them, not of the
    ranks' means, so they do not depend on the rank count; 0 when there are none, as TRL)."""
    gaps = [p["gap"] for p in parts]
    ratios = [p["ratio"] for p in parts]
    n_gap, n_ratio = sum(g[1] for g in gaps), sum(r[1] for r in ratios)
    top = [g[2] for g in gaps if g[2] is not None]
    lows = [r[2] for r in ratios if r[2] is not None]
    highs = [r[3] for r in ratios if r[3] is not None]
    return {
        "sampling/sampling_logp_difference/mean": sum(g[0] for g in gaps) / n_gap if n_gap else 0.0,
        "sampling/sampling_logp_difference/max": max(top, default=0.0),
        "sampling/importance_sampling_ratio/min": min(lows, default=0.0),
        "sampling/importance_sampling_ratio/mean": sum(r[0] for r in ratios) / n_ratio if n_ratio else 0.0,
        "sampling/importance_sampling_ratio/max": max(highs, default=0.0),
    }
