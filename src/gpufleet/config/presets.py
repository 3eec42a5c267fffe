"""Algorithm presets: the values `algorithm.name` fills in where the job leaves a field unset.

Sources: GRPO (DeepSeekMath, arXiv 2402.03300) with PPO clip 0.2; GSPO (arXiv 2507.18071, sequence-level
ratio, clip range 3e-4 / 4e-4 from its experiments); Dr.GRPO (arXiv 2503.20783: no std scaling, a
constant normaliser B x max_completion_length); DAPO (arXiv 2503.14476: clip-higher 0.2 / 0.28,
token-level mean over the whole batch).
"""

from __future__ import annotations

PRESETS: dict[str, dict[str, object]] = {
    "grpo": {
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "loss_type": "grpo",
        "importance_level": "token",
        "scale_rewards": "group",
    },
    "gspo": {
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "loss_type": "grpo",
        "importance_level": "sequence",
        "scale_rewards": "group",
    },
    "dr_grpo": {
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "loss_type": "dr_grpo",
        "importance_level": "token",
        "scale_rewards": "none",
    },
    "dapo": {
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "loss_type": "dapo",
        "importance_level": "token",
        "scale_rewards": "group",
    },
}
