"""The environment switches of the fast paths (``GPUFLEET_FAST_DECODE``, ``GPUFLEET_FUSED_LOGPROBS``,
``GPUFLEET_CPU_KERNELS``, ``GPUFLEET_CUDA_GRAPHS``): each is on unless set to 0 / false / no / off."""

from __future__ import annotations

import os

__all__ = ["switched_off"]

_OFF = ("0", "false", "no", "off")


def switched_off(variable: str) -> bool:
    """Whether environment variable ``variable`` turns its fast path off (unset: on)."""
    return os.environ.get(variable, "1").strip().lower() in _OFF
