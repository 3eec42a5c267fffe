"""Per-token surrogates of the GRPO family and the sequence masks that gate them, as pure tensor math.

Each function gives the per-token loss (before the mask and the aggregation of rl/losses.py) of one
`loss_type`, as TRL 1.16's `GRPOTrainer._compute_loss` writes it. `ratio` is the importance ratio
pi / pi_old: (B, T) at importance level "token", (B, 1) at "sequence"; `adv` is (B, 1).

* PPO clip (grpo, bnpo, dr_grpo, dapo, luspo): -min(r A, clip(r, 1 - eps, 1 + eps_high) A) (arXiv
  1707.06347), with INTELLECT-2's two-sided clip (`delta`, arXiv 2505.07291) capping the unclipped r.
* CISPO (MiniMax-M1, arXiv 2506.13585): -sg(min(r, eps_high)) A log pi: the IS weight is clipped and
  detached, every token keeps its gradient.
* SAPO (arXiv 2511.20347): -sigmoid(tau (r - 1)) 4 / tau A, a soft gate instead of the hard clip, with
  tau_pos for A > 0 and tau_neg otherwise.
* VESPO (arXiv 2602.10693): -sg(phi(w)) A log pi, phi(w) = e^lambda w^k e^(-lambda w) a Gamma weight of
  the sequence ratio w = prod_t r_t (k, lambda by the advantage's sign).
"""

from __future__ import annotations

import math

import torch


def ppo_clip(
    ratio: torch.Tensor, adv: torch.Tensor, epsilon: float, epsilon_high: float, delta: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, the ratio the clip statistics read: r, capped at `delta` when given)."""
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.minimum(capped * adv, clipped * adv), capped


def cispo(
    ratio: torch.Tensor, adv: torch.Tensor, logprobs: torch.Tensor, epsilon_high: float
) -> torch.Tensor:
    """MiniMax-M1's CISPO: the clipped, detached IS weight times A times the log-probability."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * adv * logprobs


def sapo(
    ratio: torch.Tensor, adv: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO's soft gate: sigmoid(tau (r - 1)) * 4 / tau replaces the clipped ratio (slope 1 at r = 1)."""
    tau = _pick(adv > 0, temperature_pos, temperature_neg, ratio)
    return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv


def _pick(cond: torch.Tensor, a: float, b: float, like: torch.Tensor) -> torch.Tensor:
    """where(cond, a, b) in `like`'s dtype and device (the floats rounded once, to that dtype)."""
    return torch.where(cond, torch.tensor(a, dtype=like.dtype, device=like.device), b)


@torch.no_grad()
def vespo_weights(
    adv: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """(B, 1) detached Gamma weights phi(w) = exp(lambda + k log w - lambda w) of the sequence ratio
    w = exp(sum_t log r_t) (each log r_t clamped to [-20, 20], log w to [log 1e-8, 20]), k and lambda
    from A >= 0 or A < 0; non-finite weights become 0. As TRL's `get_gamma_weights` (no vLLM IS term)."""
    lower = math.log(1e-8)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    nonneg = adv >= 0
    k = _pick(nonneg, k_pos, k_neg, log_w)
    lam = _pick(nonneg, lambda_pos, lambda_neg, log_w).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def off_policy_mask(
    adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9): (B, 1), 0 for a sequence with
    A < 0 whose mean KL estimate log pi_old - log pi = -log_ratio over its valid tokens exceeds
    `threshold`, else 1 (as TRL's `get_off_policy_mask` with the generating policy's log-probs)."""
    kl = torch.nan_to_num(-log_ratio, nan=0.0) * mask
    mean_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)
