"""The `algorithm:` section of a job file (the GRPO family's knobs, TRL 1.16's names and defaults), split
from schema.py for size; schema.py's `Job` holds it like every other section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpufleet.config.types import Section


class AlgorithmSection(Section):
    name: Literal["grpo", "gspo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "grpo"
    """Algorithm preset. It fills epsilon, epsilon_high, loss_type, importance_level and
    scale_rewards where the job leaves them unset: grpo (token-level clip 0.2, per-sequence mean),
    gspo (sequence-level ratio, clip 3e-4/4e-4, arXiv 2507.18071), dr_grpo (no std scaling, fixed
    normaliser, arXiv 2503.20783), dapo (clip-higher 0.2/0.28, token-level mean, arXiv 2503.14476),
    cispo (IS weight clipped at epsilon_high 5.0, arXiv 2506.13585), sapo (soft gate, arXiv 2511.20347),
    luspo (GSPO's sequence ratio and clip, length-unbiased sums, arXiv 2602.05261), vespo (Gamma-weighted
    sequence ratio, arXiv 2602.10693)."""

    num_generations: int = Field(8, ge=1)
    """Completions sampled per prompt (the group size G). Must be >= 2 and divide the generation batch."""

    beta: float = Field(0.0, ge=0)
    """KL penalty weight against the reference model (k3 estimator). 0: no reference model is loaded."""

    kl_bias_correction: bool = True
    """Multiply the per-token k3 KL by the importance ratio, which makes its gradient the unbiased
    reverse-KL gradient (DeepSeek-V3.2, arXiv 2512.02556; TRL's `use_bias_correction_kl`, same default).
    Changes the gradient whenever beta > 0, on-policy too (the ratio is 1 in value, not in gradient)."""

    delta: float | None = Field(None, gt=0)
    """Two-sided clipping (INTELLECT-2, arXiv 2505.07291; TRL's name): the unclipped ratio is capped at
    delta, bounding the loss of negative-advantage tokens too. Should be > 1 + epsilon_high. None: off."""

    epsilon: float | None = Field(None, ge=0)
    """Lower clip range: ratio >= 1 - epsilon. Unset: from the preset."""

    epsilon_high: float | None = Field(None, ge=0)
    """Upper clip range: ratio <= 1 + epsilon_high. Unset: from the preset (= epsilon for grpo)."""

    num_iterations: int = Field(1, ge=1)
    """Optimisation passes over each generation batch (mu in the GRPO paper)."""

    scale_rewards: Literal["group", "batch", "none"] | None = None
    """Divide advantages by the std of the group, of the batch, or not at all. Unset: from the preset."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] | None = None
    """The per-token loss and how it is averaged (see `gpufleet.rl.losses`): grpo, bnpo, dr_grpo, dapo
    (PPO clip, four averages); cispo (clipped detached IS weight x log-prob, MiniMax-M1 arXiv 2506.13585;
    clip at epsilon_high, ScaleRL suggests 5.0); sapo (soft gate, arXiv 2511.20347); luspo (sequence token
    sums, arXiv 2602.05261; importance_level sequence); vespo (Gamma weight of the sequence ratio, arXiv
    2602.10693; importance_level token). Unset: from the preset."""

    importance_level: Literal["token", "sequence"] | None = None
    """Importance ratio per token (PPO/GRPO) or per sequence (GSPO). Unset: from the preset."""

    sapo_temperature_pos: float = Field(1.0, gt=0)
    """SAPO's gate temperature for tokens with a positive advantage (TRL's name and default)."""

    sapo_temperature_neg: float = Field(1.05, gt=0)
    """SAPO's gate temperature for tokens with a non-positive advantage (TRL's name and default)."""

    vespo_k_pos: float = Field(2.0, ge=0)
    """VESPO's power k for A >= 0: how hard sequences with ratio < 1 are down-weighted (TRL's default)."""

    vespo_lambda_pos: float = Field(3.0, ge=0)
    """VESPO's decay lambda for A >= 0: how hard sequences with ratio > 1 are down-weighted (TRL's default)."""

    vespo_k_neg: float = Field(3.0, ge=0)
    """VESPO's power k for A < 0 (TRL's default)."""

    vespo_lambda_neg: float = Field(2.0, ge=0)
    """VESPO's decay lambda for A < 0 (TRL's default)."""

    off_policy_mask_threshold: float | None = Field(None, ge=0)
    """Drop (no policy loss) each negative-advantage sequence whose mean KL to the policy that generated
    it (mean of log pi_old - log pi over its tokens) exceeds this (DeepSeek-V3.2's off-policy sequence
    mask, arXiv 2512.02556, eq. 9; TRL's name, e.g. 0.5). None: off. On-policy it drops nothing."""

    router_aux_loss_coef: float | None = None
    """Weight of a Mixture-of-Experts model's router load-balancing loss (Hugging Face's
    `load_balancing_loss_func` over every MoE layer's router logits), added to the loss: + coef x aux_loss.
    TRL takes it per forward (/ accumulation steps); gpufleet over the optimizer step's attended tokens on
    every rank, so micro_batch and the rank count do not change it (the same as TRL's for one micro-batch
    on one rank). TRL's name and default: None takes the model config's own `router_aux_loss_coef`
    (Qwen2-MoE / Qwen3-MoE: 0.001) for a model that returns router logits, and is off (0) for any other; 0
    turns it off. Logged as `aux_loss`."""

    importance_sampling_correction: bool = True
    """Correct for the sampler not being the trainer (TRL's `vllm_importance_sampling_correction`, same
    default): where a dedicated rollout rank samples (placement.rollout; a copy of the policy in the
    compute dtype, rollout.async_steps steps behind), each completion's policy loss is weighted by the
    truncated importance ratio pi_trainer / pi_sampler of the tokens it sampled (TRL's truncated IS, with
    the modes below). Colocated sampling is the trainer itself: nothing to correct there."""

    importance_sampling_mode: Literal[
        "sequence_mask", "sequence_truncate", "token_mask", "token_truncate"
    ] = "sequence_mask"
    """How the sampler ratio is bounded (TRL's `vllm_importance_sampling_mode`, same default): `token_*` per
    token, `sequence_*` one ratio per completion (the exp of the sum of its tokens' log-ratios); `*_truncate`
    clamps it to [clip_min, clip_max], `*_mask` sets it to 0 (no policy loss) outside them."""

    importance_sampling_clip_max: float | None = Field(3.0, gt=0)
    """Upper bound of the sampler ratio (TRL's `vllm_importance_sampling_clip_max`, same default). None: none."""

    importance_sampling_clip_min: float | None = Field(None, ge=0)
    """Lower bound of the sampler ratio (TRL's `vllm_importance_sampling_clip_min`, same default). None: none."""

    mask_truncated_completions: bool = False
    """A completion cut at rollout.max_completion_length (no EOS) gets no loss and counts in no token
    normaliser (DAPO, arXiv 2503.14476; TRL's name and default)."""

    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """Train the policy term only on the highest-entropy tokens: those at or above this quantile from the
    top of the optimizer step's valid tokens over all ranks ("Beyond the 80/20 rule", arXiv 2506.01939,
    recommends 0.2; TRL's name and default 1.0 = every token; 0 keeps only the highest). The threshold is
    taken over the whole step before its micro-batches run (one extra no-grad forward), so it does not
    depend on train.micro_batch (TRL takes it per forward pass)."""

    entropy_coef: float = 0.0
    """Weight of an entropy bonus: the loss minus entropy_coef x the mean entropy of the trained tokens
    (TRL's name and default; 0: off). With use_adaptive_entropy, the starting coefficient."""

    use_adaptive_entropy: bool = False
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312; TRL's name): after each optimizer step the
    coefficient grows by entropy_coef_delta when the step's mean entropy is at or below entropy_target and
    shrinks otherwise (within entropy_coef_min / max); the bonus applies only while the last step's entropy
    was at or below the target. Its state is saved in checkpoints and resumes exactly."""

    entropy_coef_min: float = Field(0.0, ge=0)
    """Lower bound of the adaptive entropy coefficient (TRL's default)."""

    entropy_coef_max: float = Field(1.0, ge=0)
    """Upper bound of the adaptive entropy coefficient (TRL's default)."""

    entropy_coef_delta: float = Field(0.005, ge=0)
    """Step of the adaptive entropy coefficient per optimizer step (TRL's default)."""

    entropy_target: float = Field(0.2, ge=0)
    """Target mean per-token entropy (nats) of adaptive entropy control (TRL's default 0.2 almost never
    triggers: language models sit at 2-10 nats; set it near the entropy seen early in training)."""

    sync_ref_model: bool = False
    """Move the KL reference toward the policy during training (TR-DPO, arXiv 2404.09656; TRL's name and
    default): every ref_model_sync_steps optimizer steps, reference = alpha x policy + (1 - alpha) x
    reference. Needs beta > 0 and a full (not LoRA) policy; the mixed reference is saved in checkpoints."""

    ref_model_sync_steps: int = Field(512, ge=1)
    """tau of TR-DPO: optimizer steps between two reference syncs (TRL's default)."""

    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1)
    """alpha of TR-DPO: the policy's share in the mixed reference (TRL's default)."""
