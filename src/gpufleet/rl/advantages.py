"""Rewards to group-relative advantages (GRPO family), as pure tensor math (torch only).

The advantage of a completion is its reward minus the mean reward of its group (the completions
sampled for the same prompt), optionally divided by a standard deviation:

* "group": the group's std (GRPO, DeepSeekMath arXiv 2402.03300);
* "batch": the std of the whole batch (a more robust scale, as TRL scale_rewards="batch");
* "none": no division, which removes the question-level difficulty bias (Dr.GRPO, arXiv 2503.20783).

Several reward functions are aggregated as TRL 1.16's `multi_objective_aggregation` says:
"sum_then_normalize" (weighted sum, then the above) or "normalize_then_sum" (each function normalised in
its group, then weighted and summed, then divided by the batch std: GDPO, arXiv 2601.05242).

A completion that every reward function returned None for (all NaN) is *unscorable*: its reward is NaN,
it is left out of every mean and std (nan-aware, Bessel-corrected as TRL's `nanstd`) and gets advantage 0.

The math follows TRL's `GRPOTrainer._generate_and_score_completions` (1.16) so that reward and advantage
curves are comparable: "reward" and "reward_std" are the nan-aware mean and std of the whole batch's
rewards, "frac_reward_zero_std" the fraction of completions whose std (the one the advantage is divided
by: the group's, or the batch's under scale="batch") is zero.
"""

from __future__ import annotations

import torch

SCALES: tuple[str, ...] = ("group", "batch", "none")
AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased (Bessel) std ignoring NaN entries, as TRL's `trl.trainer.utils.nanstd`: NaN where fewer than
    two entries are not NaN."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(variance.dtype)
    correction = torch.where(
        count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, torch.nan)
    )
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.reshape(())


def unscorable(per_function: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the rows where every reward function returned None (NaN)."""
    return torch.isnan(per_function).all(dim=1)


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of several reward functions, ignoring "not applicable" entries.

    Args:
        per_function: (N, F) reward of each of the N completions under each of the F reward
            functions. NaN means the function returned None ("not applicable to this sample").
        weights: (F,) weight of each reward function.

    Returns:
        (N,) rewards: nansum(per_function * weights, dim=1), as TRL 1.16 does. A NaN entry
        contributes nothing; a row where every function returned NaN is unscorable: NaN.

    Raises:
        ValueError: `per_function` is not 2-D or `weights` is not (F,).
    """
    if per_function.dim() != 2:
        raise ValueError(f"per_function must be (N, F), got shape {tuple(per_function.shape)}")
    if weights.shape != per_function.shape[1:]:
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}, expected ({per_function.shape[1]},): one per reward function"
        )
    weights = weights.to(device=per_function.device, dtype=per_function.dtype)
    rewards = torch.nansum(per_function * weights.unsqueeze(0), dim=1)
    return rewards.masked_fill(unscorable(per_function), torch.nan)


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale: str = "group",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages: reward minus its group mean, optionally divided by a std.

    Args:
        rewards: (N,) one reward per completion, NaN for an unscorable one; rows [g*G:(g+1)*G] are
            the G completions of group (prompt) g, with G = `num_generations`.
        num_generations: G, the group size. N must be a multiple of G.
        scale: "group" (divide by the group's std + eps), "batch" (divide by the std of all N
            rewards + eps) or "none" (no division, Dr.GRPO).
        eps: added to the std before dividing (must be > 0 unless scale="none"), so that a group
            of identical rewards (std 0, centred rewards 0) gets advantage 0 rather than NaN.

    Returns:
        (advantages, stats): advantages is (N,), 0 for NaN rewards and wherever the std is
        undefined (fewer than two scorable completions); stats are python floats (module docstring):
        "reward", "reward_std", "frac_reward_zero_std". A group of one completion (G = 1) has std 0.

    Raises:
        ValueError: unknown `scale`, `num_generations` < 1, N not a multiple of it, or
            eps <= 0 with a scale that divides.
    """
    rewards = _checked(rewards, num_generations, scale, eps)
    n = rewards.shape[0]
    if n == 0:
        return rewards.clone(), {"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 0.0}
    grouped = rewards.reshape(n // num_generations, num_generations)  # (N / G, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = _std_or_zero(rewards).expand_as(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:  # the std of a single sample: 0 (its advantage is 0 anyway), as TRL
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + eps)
    return torch.nan_to_num(advantages, nan=0.0), _reward_stats(rewards, std)


def normalized_advantages(
    per_function: torch.Tensor, weights: torch.Tensor, num_generations: int, eps: float = 1e-4
) -> tuple[torch.Tensor, dict[str, float]]:
    """GDPO (arXiv 2601.05242), TRL's multi_objective_aggregation="normalize_then_sum": each function's
    rewards minus their group mean over their group std + eps (nan-aware), weighted and summed, then
    centred on the batch mean and divided by the batch std + eps (scale_rewards plays no part). Unscorable
    rows get advantage 0; the stats are those of the weighted raw rewards (module docstring)."""
    rewards = combine_rewards(per_function, weights)  # validates the shapes
    n, f = per_function.shape
    _checked(rewards, num_generations, "group", eps)
    if n == 0:
        return rewards.clone(), {"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 0.0}
    grouped = per_function.reshape(n // num_generations, num_generations, f)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    normed = ((grouped - mean_k) / (std_k + eps)).reshape(n, f)
    summed = combine_rewards(normed, weights)
    std = _std_or_zero(summed).expand_as(summed)
    advantages = torch.nan_to_num((summed - torch.nanmean(summed)) / (std + eps), nan=0.0)
    return advantages, _reward_stats(rewards, std)


def _std_or_zero(x: torch.Tensor) -> torch.Tensor:
    """nanstd of all of `x` (0-d), or 0 for a single element (TRL's convention)."""
    return nanstd(x) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def _reward_stats(rewards: torch.Tensor, std: torch.Tensor) -> dict[str, float]:
    """TRL's logged reward figures: nan-aware batch mean and std of `rewards`, and the fraction of rows whose
    dividing `std` is zero (a NaN std, of fewer than two scorable completions, is not zero)."""
    with torch.no_grad():
        scored = rewards[~torch.isnan(rewards)]
        zero_std = torch.isclose(std, torch.zeros_like(std))  # isclose: rounding of equal floats, as TRL
        return {
            "reward": scored.mean().item() if scored.numel() else float("nan"),
            "reward_std": nanstd(rewards).item() if rewards.numel() > 1 else 0.0,
            "frac_reward_zero_std": zero_std.float().mean().item(),
        }


def _checked(rewards: torch.Tensor, num_generations: int, scale: str, eps: float) -> torch.Tensor:
    """Raise ValueError on what `group_advantages` refuses; `rewards` as a floating tensor."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not supported; expected one of {SCALES}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got shape {tuple(rewards.shape)}")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if scale != "none" and not eps > 0.0:
        raise ValueError(f"eps must be > 0 when scale={scale!r} (a zero-std group would give 0/0), got {eps}")
    if rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"the number of rewards ({rewards.shape[0]}) is not a multiple of num_generations ({num_generations})"
        )
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def advantages_of(
    per_function: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str, aggregation: str
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages, rewards, stats) of a generation batch's (N, F) rewards per function, aggregated as
    `aggregation` says (module docstring); `rewards` is the weighted sum, NaN where unscorable."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not supported; expected one of {AGGREGATIONS}")
    rewards = combine_rewards(per_function, weights)
    if aggregation == "normalize_then_sum":
        advantages, stats = normalized_advantages(per_function, weights, num_generations)
    else:
        advantages, stats = group_advantages(rewards, num_generations, scale=scale)
    return advantages, rewards, stats
