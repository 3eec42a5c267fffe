"""Algorithm presets: the values `algorithm.name` fills in where the job leaves a field unset.

Sources: GRPO (DeepSeekMath, arXiv 2402.03300) with PPO clip 0.2; GSPO (arXiv 2507.18071, sequence-level
ratio, clip range 3e-4 / 4e-4 from its experiments); Dr.GRPO (arXiv 2503.20783: no std scaling, a
constant normaliser B x max_completion_length); DAPO (arXiv 2503.14476: clip-higher 0.2 / 0.28,
token-level mean over the whole batch); CISPO (MiniMax-M1, arXiv 2506.13585: the IS weight clipped at
epsilon_high = 5.0 as ScaleRL arXiv 2510.13786 and TRL 1.16's docs recommend, global token mean); SAPO
(arXiv 2511.20347: soft gate, temperatures 1.0 / 1.05 as TRL's defaults, per-sequence mean); LUSPO (arXiv
2602.05261: GSPO's sequence-level ratio and clip range, sequence token sums); VESPO (arXiv 2602.10693:
token-level log-ratios summed into its sequence weight, global token mean; the clip range is unused).
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
    "cispo": {
        "epsilon": 0.2,
        "epsilon_high": 5.0,
        "loss_type": "cispo",
        "importance_level": "token",
        "scale_rewards": "group",
    },
    "sapo": {
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "loss_type": "sapo",
        "importance_level": "token",
        "scale_rewards": "group",
    },
    "luspo": {
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "loss_type": "luspo",
        "importance_level": "sequence",
        "scale_rewards": "group",
    },
    "vespo": {
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "loss_type": "vespo",
        "importance_level": "token",
        "scale_rewards": "group",
    },
}
