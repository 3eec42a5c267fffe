"""Rewards to group-relative advantages (GRPO family), as pure tensor math (torch only).

The advantage of a completion is its reward minus the mean reward of its group (the completions
sampled for the same prompt), optionally divided by a standard deviation:

* "group": the group's std (GRPO, DeepSeekMath arXiv 2402.03300);
* "batch": the std of the whole batch (a more robust scale, as TRL scale_rewards="batch");
* "none": no division, which removes the question-level difficulty bias (Dr.GRPO, arXiv 2503.20783).

The math follows TRL's `GRPOTrainer` (1.16) so that reward and advantage curves are comparable.
"""

from __future__ import annotations

import torch

SCALES: tuple[str, ...] = ("group", "batch", "none")


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of several reward functions, ignoring "not applicable" entries.

    Args:
        per_function: (N, F) reward of each of the N completions under each of the F reward
            functions. NaN means the function returned None ("not applicable to this sample").
        weights: (F,) weight of each reward function.

    Returns:
        (N,) rewards: nansum(per_function * weights, dim=1), as TRL 1.16 does. A NaN entry
        contributes nothing; a row where every function returned NaN gets reward 0.0.

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
    return torch.nansum(per_function * weights.unsqueeze(0), dim=1)


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale: str = "group",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages: reward minus its group mean, optionally divided by a std.

    Args:
        rewards: (N,) one reward per completion; rows [g*G:(g+1)*G] are the G completions of
            group (prompt) g, with G = `num_generations`.
        num_generations: G, the group size. N must be a multiple of G.
        scale: "group" (divide by the group's std + eps), "batch" (divide by the std of all N
            rewards + eps) or "none" (no division, Dr.GRPO).
        eps: added to the std before dividing (must be > 0 unless scale="none"), so that a group
            of identical rewards (std 0, centred rewards 0) gets advantage 0 rather than NaN.

    Returns:
        (advantages, stats): advantages is (N,); stats are python floats: "reward" (mean
        reward), "reward_std" (mean over groups of the group std, whatever `scale` is) and
        "frac_reward_zero_std" (fraction of groups whose rewards are all equal, i.e. that give
        no learning signal). A group of one completion (G = 1) has std 0 by definition.

    Raises:
        ValueError: unknown `scale`, `num_generations` < 1, N not a multiple of it, or
            eps <= 0 with a scale that divides.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not supported; expected one of {SCALES}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got shape {tuple(rewards.shape)}")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if scale != "none" and not eps > 0.0:
        raise ValueError(f"eps must be > 0 when scale={scale!r} (a zero-std group would give 0/0), got {eps}")
    n = rewards.shape[0]
    if n % num_generations != 0:
        raise ValueError(
            f"the number of rewards ({n}) is not a multiple of num_generations ({num_generations})"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if n == 0:
        return rewards.clone(), {"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 0.0}

    grouped = rewards.reshape(n // num_generations, num_generations)  # (N / G, G)
    # Unbiased std (Bessel correction, torch.std's default) as TRL 1.16 does, so that our
    # advantages and logged reward_std match TRL's and training curves are comparable.
    # The std of a single sample is undefined (NaN); we define it as 0 (its advantage is 0 anyway).
    if num_generations > 1:
        group_std = grouped.std(dim=1)
    else:
        group_std = torch.zeros(grouped.shape[0], dtype=rewards.dtype, device=rewards.device)
    advantages = rewards - grouped.mean(dim=1).repeat_interleave(num_generations)
    if scale == "group":
        advantages = advantages / (group_std.repeat_interleave(num_generations) + eps)
    elif scale == "batch":
        batch_std = rewards.std() if n > 1 else torch.zeros((), dtype=rewards.dtype, device=rewards.device)
        advantages = advantages / (batch_std + eps)

    with torch.no_grad():
        # isclose rather than == 0: the std of equal floats can be a rounding error (TRL does the same).
        zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
        stats = {
            "reward": rewards.mean().item(),
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": zero_std.float().mean().item(),
        }
    return advantages, stats
