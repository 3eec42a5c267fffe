"""Entropy in the loss: the high-entropy token mask ("Beyond the 80/20 rule", arXiv 2506.01939) and the
entropy bonus with adaptive control (Skywork-OR1, arXiv 2505.22312), as TRL 1.16's `GRPOTrainer` defines
them; the statistics are taken over the whole optimizer step (all micro-batches and ranks) so the
gradient does not depend on the micro-batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def entropy_threshold(valid_entropies: torch.Tensor, top_quantile: float) -> float:
    """The entropy at quantile 1 - `top_quantile` of the step's valid tokens (all ranks'): tokens at or above
    it are trained (TRL's `get_high_entropy_mask`); +inf when there are none."""
    if valid_entropies.numel() == 0:
        return math.inf
    return torch.quantile(valid_entropies.float(), 1.0 - top_quantile).item()


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, T) float: 1 for valid tokens whose entropy is >= `threshold`."""
    valid = mask.bool()
    return ((entropy.detach() * valid >= threshold) & valid).to(mask.dtype)


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient and, with `adaptive`, its controller (the state a checkpoint keeps)."""

    coef: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    last_entropy: float = math.inf
    """The previous optimizer step's mean entropy (inf before the first: no bonus yet, as TRL)."""

    @classmethod
    def from_job(cls, job) -> EntropyControl:
        a = job.algorithm
        return cls(
            a.entropy_coef,
            a.use_adaptive_entropy,
            a.entropy_target,
            a.entropy_coef_min,
            a.entropy_coef_max,
            a.entropy_coef_delta,
        )

    @property
    def enabled(self) -> bool:
        """Whether the bonus term is part of the loss (adaptive: always, its coefficient may recover)."""
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient this step's bonus uses: set at the end of the previous step."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def update(self, step_entropy: float) -> None:
        """After an optimizer step: move the coefficient toward keeping the entropy above the target."""
        if not self.adaptive:
            return
        if step_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = step_entropy

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
