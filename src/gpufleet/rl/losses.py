"""Clipped policy-gradient loss of the GRPO family, as pure tensor math (torch only).

One function, `policy_loss`, covers the variants that differ in three places:

* where the importance ratio lives (`level`):
  - "token": one ratio per token, PPO style (GRPO, DeepSeekMath arXiv 2402.03300);
  - "sequence": one length-normalised ratio per sequence (GSPO, arXiv 2507.18071).
* how the per-token losses are averaged (`loss_type`):
  - "grpo": mean over each sequence's tokens, then mean over sequences (arXiv 2402.03300);
  - "bnpo": mean over all tokens of the batch;
  - "dr_grpo": token sum over a constant B * max_completion_length (Dr.GRPO, arXiv 2503.20783);
  - "dapo": token sum over the global token count (DAPO, arXiv 2503.14476);
  - "luspo": token sum of each sequence, mean over sequences (LUSPO, arXiv 2602.05261);
  - "cispo", "vespo": global token mean as dapo; "sapo": as grpo.
* the per-token surrogate (rl/surrogates.py): PPO clip (grpo, bnpo, dr_grpo, dapo, luspo), CISPO's
  clipped detached IS weight (arXiv 2506.13585), SAPO's soft gate (arXiv 2511.20347), VESPO's Gamma
  weight of the sequence ratio (arXiv 2602.10693).

The math follows TRL's `GRPOTrainer._compute_loss` (1.16) so that loss curves are comparable.

`Loss` is `policy_loss` configured once from the job (tiny-grpo's habit): `loss(logprobs, batch,
normalizer)` takes the generation batch, and `Loss.normalizer` gives each optimizer step's global
denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpufleet.rl import surrogates

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS: tuple[str, ...] = ("token", "sequence")
SEQUENCE_MEAN = ("grpo", "sapo")
"""Loss types whose loss is the mean over sequences of each sequence's token mean."""
GLOBAL_TOKEN_MEAN = ("dapo", "cispo", "vespo")
"""Loss types whose loss is the token sum over the global number of valid tokens."""


@dataclass(frozen=True)
class LossOptions:
    """The knobs of the family's newer members (defaults: TRL 1.16's)."""

    delta: float | None = None
    """INTELLECT-2 two-sided clip: cap the unclipped ratio at delta (PPO-clip types). None: off."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for A > 0."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for A <= 0."""
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    """VESPO's (k_pos, lambda_pos, k_neg, lambda_neg)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask threshold. None: off."""


def _k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) from log_ratio = ref_logprobs - logprobs.

    k3 = exp(log_ratio) - log_ratio - 1: unbiased, always >= 0, low variance.
    Source: http://joschu.net/blog/kl-approx.html
    """
    return torch.exp(log_ratio) - log_ratio - 1.0


def _masked_fraction(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of valid tokens where `flags` is true (0.0 when there are no valid tokens)."""
    count = (flags & mask).sum().to(torch.float64)
    return (count / mask.sum().clamp(min=1)).item()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    loss_type: str = "grpo",
    level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    normalizer: float | None = None,
    kl_bias_correction: bool = False,
    options: LossOptions = LossOptions(),  # noqa: B008 (frozen, never mutated)
    token_weights: torch.Tensor | None = None,
    sampler_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss (plus optional k3 KL penalty) of a group-relative RL step.

    Args:
        logprobs: (B, T) log-probabilities of the sampled tokens under the current policy. The
            gradient flows through this tensor only.
        old_logprobs: (B, T) log-probabilities under the policy that generated the samples.
            Treated as a constant (detached).
        advantages: (B,) one advantage per sequence (constant, detached).
        mask: (B, T) 1 for completion tokens, 0 for padding / tokens after EOS (bool or float).
            Masked positions never affect the loss, the gradient or the stats, whatever values
            the log-probability tensors hold there (even inf / NaN).
        ref_logprobs: (B, T) log-probabilities under the reference policy (constant). Required
            when `beta != 0`; when given with `beta == 0` it is only used for the "kl" stat.
        loss_type: "grpo", "bnpo", "dr_grpo" or "dapo" (see the module docstring).
        level: "token" (one ratio per token) or "sequence" (GSPO: one ratio per sequence,
            exp of the mean log-ratio over its valid tokens, shared by all its tokens).
        epsilon: lower clip range; the ratio is clipped to [1 - epsilon, 1 + epsilon_high].
        epsilon_high: upper clip range (DAPO "clip-higher"); None means `epsilon`.
        beta: weight of the per-token k3 KL penalty added to the per-token loss.
        max_completion_length: the constant L of "dr_grpo" (denominator B * L). Required for
            "dr_grpo" unless `normalizer` is given.
        normalizer: when given, it REPLACES the final denominator of the aggregation:
            "grpo" -> (sum of per-sequence token means) / normalizer;
            "bnpo", "dapo", "dr_grpo" -> (sum of masked token losses) / normalizer.
            The trainer passes a *global* count (number of sequences for "grpo", number of
            valid tokens for "bnpo"/"dapo", B * max_completion_length for "dr_grpo", all
            summed over micro-batches and ranks). Each micro-batch then contributes its exact
            share and the summed gradient does not depend on how the batch was split across
            micro-batches or ranks. Must be > 0: a trainer that may see zero valid tokens
            should pass max(count, 1).
        kl_bias_correction: multiply the per-token k3 KL by the importance ratio (with its
            gradient), DeepSeek-V3.2's unbiased reverse-KL gradient (arXiv 2512.02556), as TRL's
            `use_bias_correction_kl`. On-policy the ratio is 1 in value but not in gradient. At
            level "sequence" the sequence's ratio multiplies each of its tokens' KL (as TRL).
        options: `delta` (two-sided clip, INTELLECT-2 arXiv 2505.07291: the unclipped ratio is
            capped at delta before the min), SAPO's temperatures, VESPO's (k, lambda) pairs and the
            off-policy sequence mask threshold (`LossOptions`; rl/surrogates.py has the formulas).
        token_weights: (B, T) 0/1 weights of the policy term only (the KL keeps every token), e.g.
            the top-entropy token mask; None: all 1.
        sampler_weights: (B, T) truncated importance weights of another sampler (constant): they
            multiply the policy term only, before the KL is added (TRL's vLLM IS correction); None: 1.

    Returns:
        (loss, stats): `loss` is a 0-d tensor; `stats` holds python floats computed without
        gradient: "clip_ratio/low_mean" (ratio < 1 - epsilon and A < 0), "clip_ratio/high_mean"
        (ratio > 1 + epsilon_high and A > 0), "clip_ratio/region_mean" (either) — fractions of
        valid tokens at level "token", of sequences (rows) at level "sequence", as TRL — and "kl"
        (masked token mean of the (corrected) k3 KL, 0.0 without `ref_logprobs`). With an
        all-zero mask the loss is 0 and every stat is 0.0.

    Raises:
        ValueError: unknown `loss_type` or `level`, mismatched shapes, `beta != 0` without
            `ref_logprobs`, "dr_grpo" without `max_completion_length` or `normalizer`, or a
            `normalizer` that is not > 0.
    """
    # Reads top to bottom as the papers write it: ratio, surrogate, masks, KL, aggregation; the checks,
    # the ratio, the surrogates (rl/surrogates.py) and the aggregation are helpers.
    normalizer = _check_options(
        loss_type, level, beta, ref_logprobs is not None, max_completion_length, normalizer
    )
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    shape = logprobs.shape
    if epsilon_high is None:
        epsilon_high = epsilon

    valid = mask.bool()
    mask_f = valid.to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # (B, 1)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    # log(pi / pi_old), forced to 0 at masked positions: padding may hold garbage (even -inf),
    # and 0 * inf would otherwise turn the loss or the gradient into NaN.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), zero)
    ratio = _importance_ratio(log_ratio, mask_f, level)
    per_token, stats = _surrogate(
        loss_type, ratio, adv, logprobs, log_ratio, valid, epsilon, epsilon_high, options
    )
    per_token = per_token.expand(shape)
    if options.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 off-policy sequence mask
        per_token = per_token * surrogates.off_policy_mask(
            adv, log_ratio, mask_f, options.off_policy_mask_threshold
        )
    if token_weights is not None:  # e.g. the top-entropy token mask (only the policy term, as TRL)
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    if sampler_weights is not None:  # the sampler was not this policy (rl/offpolicy.py)
        per_token = per_token * sampler_weights.detach().to(per_token.dtype)

    kl = None
    if ref_logprobs is not None:
        # k3 KL estimator, http://joschu.net/blog/kl-approx.html ; 0 at masked positions.
        kl = _k3_kl(torch.where(valid, ref_logprobs.detach() - logprobs, zero))
        if kl_bias_correction:  # DeepSeek-V3.2: times the (differentiable) importance ratio
            kl = kl * ratio
        if beta != 0.0:
            per_token = per_token + beta * kl

    loss = _aggregate(per_token * mask_f, mask_f, loss_type, normalizer, max_completion_length)
    stats["kl"] = 0.0 if kl is None else (kl.detach().sum() / mask_f.sum().clamp(min=1.0)).item()
    return loss, stats


def _importance_ratio(log_ratio: torch.Tensor, mask_f: torch.Tensor, level: str) -> torch.Tensor:
    """exp(log r): (B, T) at level "token"; at "sequence" GSPO's (arXiv 2507.18071) s_i = exp(mean_t log r_it)
    over the sequence's valid tokens, (B, 1), as TRL importance_sampling_level="sequence"."""
    if level == "token":
        return torch.exp(log_ratio)
    return torch.exp(log_ratio.sum(-1, keepdim=True) / mask_f.sum(-1, keepdim=True).clamp(min=1.0))


def _surrogate(loss_type, ratio, adv, logprobs, log_ratio, valid, epsilon, epsilon_high, options):
    """The per-token loss of `loss_type` (rl/surrogates.py) and its statistics (floats, no gradient): the
    clip fractions of the PPO-clip family (of valid tokens; of rows when `ratio` is per sequence, as TRL),
    "cispo_clip_ratio" for cispo, "vespo/phi_seq_mean" (mean over rows) for vespo, none for sapo."""
    where = valid if ratio.shape[-1] == valid.shape[-1] else torch.ones_like(ratio, dtype=torch.bool)
    stats: dict[str, float] = {}
    if loss_type == "cispo":
        per_token = surrogates.cispo(ratio, adv, torch.where(valid, logprobs, 0.0), epsilon_high)
        with torch.no_grad():
            stats["cispo_clip_ratio"] = _masked_fraction((ratio > epsilon_high) & (adv > 0), where)
    elif loss_type == "sapo":
        per_token = surrogates.sapo(ratio, adv, options.sapo_temperature_pos, options.sapo_temperature_neg)
    elif loss_type == "vespo":
        phi = surrogates.vespo_weights(adv, log_ratio, valid.to(ratio.dtype), *options.vespo)
        per_token = -phi * adv * torch.where(valid, logprobs, 0.0)
        stats["vespo/phi_seq_mean"] = phi.mean().item() if phi.numel() else 0.0
    else:
        per_token, capped = surrogates.ppo_clip(ratio, adv, epsilon, epsilon_high, options.delta)
        with torch.no_grad():
            r = capped.detach()
            is_low = (r < 1.0 - epsilon) & (adv < 0)
            is_high = (r > 1.0 + epsilon_high) & (adv > 0)
            stats["clip_ratio/low_mean"] = _masked_fraction(is_low, where)
            stats["clip_ratio/high_mean"] = _masked_fraction(is_high, where)
            stats["clip_ratio/region_mean"] = _masked_fraction(is_low | is_high, where)
    return per_token, stats


def _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs) -> None:
    """Raise ValueError unless the tensors are (B, T) alike and advantages (B,)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "mask": mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} like logprobs")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({shape[0]},)")


def _check_options(
    loss_type: str, level: str, beta: float, has_ref: bool, max_completion_length: int | None, normalizer
) -> float | None:
    """Raise ValueError on options `policy_loss` refuses (see its docstring); the normalizer as a float."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; expected one of {LOSS_TYPES}")
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is not supported; expected one of {LEVELS}")
    if beta != 0.0 and not has_ref:
        raise ValueError(f"beta={beta} needs ref_logprobs for the KL penalty; pass them or set beta=0")
    if loss_type == "dr_grpo" and max_completion_length is None and normalizer is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (or an explicit normalizer)")
    if max_completion_length is not None and max_completion_length <= 0:
        raise ValueError(f"max_completion_length must be > 0, got {max_completion_length}")
    if normalizer is not None:
        normalizer = float(normalizer)
        if not normalizer > 0.0:  # also rejects NaN
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return normalizer


def _aggregate(
    per_token: torch.Tensor,
    mask_f: torch.Tensor,
    loss_type: str,
    normalizer: float | None,
    max_completion_length: int | None,
) -> torch.Tensor:
    """The masked per-token losses (B, T) reduced to the loss as `loss_type` says (module docstring)."""
    shape = per_token.shape
    if loss_type in SEQUENCE_MEAN:
        # DeepSeekMath GRPO: per-sequence token mean, then mean over sequences.
        seq_mean = per_token.sum(-1) / mask_f.sum(-1).clamp(min=1.0)
        denom = normalizer if normalizer is not None else max(shape[0], 1)
        loss = seq_mean.sum() / denom
    elif loss_type == "luspo":
        # LUSPO (arXiv 2602.05261): each sequence's token *sum* (its length scales it), mean over sequences.
        denom = normalizer if normalizer is not None else max(shape[0], 1)
        loss = per_token.sum() / denom
    elif loss_type == "dr_grpo":
        # Dr.GRPO (arXiv 2503.20783): a constant denominator removes the length bias.
        denom = normalizer if normalizer is not None else max(shape[0] * max_completion_length, 1)
        loss = per_token.sum() / denom
    else:
        # "bnpo": tokens of this call; "dapo" (arXiv 2503.14476), "cispo", "vespo": token-level mean,
        # with the trainer passing the global token count as `normalizer`.
        denom = normalizer if normalizer is not None else mask_f.sum().clamp(min=1.0)
        loss = per_token.sum() / denom

    return loss


@dataclass(frozen=True)
class Loss:
    """`policy_loss` configured once from the job, taking the batch noun: `loss(logprobs, batch, normalizer)`.

    `batch` is anything with `old_logprobs` (None: the batch is on-policy, ratio 1), `advantages`,
    `completion_mask` and `ref_logprobs` (rl/batch.py `GenerationBatch`). The normaliser of one optimizer
    step comes from `normalizer` (global counts, see `policy_loss`)."""

    loss_type: str = "grpo"
    level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_completion_length: int | None = None
    kl_bias_correction: bool = False
    options: LossOptions = LossOptions()

    @classmethod
    def from_job(cls, job) -> Loss:
        a = job.algorithm
        return cls(
            a.loss_type,
            a.importance_level,
            a.epsilon,
            a.epsilon_high,
            a.beta,
            job.completion_tokens(),  # dr_grpo's constant L: an episode's token budget with an env
            a.kl_bias_correction,
            LossOptions(
                a.delta,
                a.sapo_temperature_pos,
                a.sapo_temperature_neg,
                (a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg),
                a.off_policy_mask_threshold,
            ),
        )

    def __call__(
        self, logprobs: torch.Tensor, batch, normalizer: float | None = None, token_weights=None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        return policy_loss(
            logprobs,
            old,
            batch.advantages,
            batch.completion_mask,
            ref_logprobs=batch.ref_logprobs,
            loss_type=self.loss_type,
            level=self.level,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            max_completion_length=self.max_completion_length,
            normalizer=normalizer,
            kl_bias_correction=self.kl_bias_correction,
            options=self.options,
            token_weights=token_weights,
            sampler_weights=getattr(batch, "sampler_weights", None),
        )

    def normalizer(self, rows: int, tokens: int, global_tokens: int, ranks: int) -> float:
        """The denominator of one optimizer step from this rank's `rows` and `tokens`, the valid tokens
        of all policy ranks and the rank count: rows for grpo, valid tokens for dapo, rows x
        max_completion_length for dr_grpo (all global); bnpo uses this rank's tokens, as its definition
        says."""
        if self.loss_type in (*SEQUENCE_MEAN, "luspo"):
            return rows * ranks
        if self.loss_type == "bnpo":
            return max(tokens, 1)
        if self.loss_type == "dr_grpo":
            return rows * ranks * (self.max_completion_length or 0)
        return max(global_tokens, 1)  # dapo, cispo, vespo

    def by_rows(self, key: str) -> bool:
        """Whether the statistic `key` is a mean over sequences (weighted by rows across micro-batches and
        ranks) rather than over valid tokens: VESPO's weight, and the clip fractions at level sequence (TRL's
        `global_masked_mean` of a per-sequence tensor)."""
        return key == "vespo/phi_seq_mean" or (self.level == "sequence" and key != "kl")

    def rank_scale(self, ranks: int) -> int:
        """DDP and FSDP average gradients over ranks: the loss is multiplied by this so that the reduced
        gradient is the gradient of the global loss (bnpo is a per-rank mean: 1)."""
        return ranks if self.loss_type != "bnpo" else 1

    def global_loss(self, summed: float, ranks: int) -> float:
        """The step's loss metric from the sum over ranks of each rank's accumulated loss."""
        return summed if self.loss_type != "bnpo" else summed / ranks
