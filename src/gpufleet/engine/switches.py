"""The environment switches of the fast paths (``GPUFLEET_FAST_DECODE``, ``GPUFLEET_FUSED_LOGPROBS``,
``GPUFLEET_CPU_KERNELS``, ``GPUFLEET_CUDA_GRAPHS``, ``GPUFLEET_FUSED_LAYERS``, ``GPUFLEET_PACKED``,
``GPUFLEET_KEEP_FREED``):
each is on unless set to 0 / false / no / off."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FUSED_LAYERS", "FUSED_LOGPROBS", "PACKED", "switched_off"]

FUSED_LAYERS = "GPUFLEET_FUSED_LAYERS"
"""Set to 0 to run the models' own RMSNorm, attention and MLP code in the training forward on CPU (engine/fusedlayers.py;
named here for the planner, which imports no torch)."""

FUSED_LOGPROBS = "GPUFLEET_FUSED_LOGPROBS"
"""Set to 0 to take the log-probs from the completion's whole logits (engine/loghead.py; packing needs the fused head)."""

PACKED = "GPUFLEET_PACKED"
"""Set to 0 to run the CPU training forward on the padded micro-batch, not its sequences packed (engine/packing.py)."""

_OFF = ("0", "false", "no", "off")


def switched_off(variable: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether environment variable ``variable`` (of ``env``, default the process's) turns its fast path
    off (unset: on)."""
    return (os.environ if env is None else env).get(variable, "1").strip().lower() in _OFF
