"""The per-process framework overhead the planner adds: a setting (not a job field), read once.

CUDA context, cuBLAS/NCCL workspaces and allocator slack: `DEFAULT_GPU_OVERHEAD` (1 GiB) per process on
a GPU, `DEFAULT_CPU_OVERHEAD` per process on the CPU; override with GPUFLEET_PLAN_OVERHEAD=1.5GB.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpufleet.errors import UserError
from gpufleet.plan.memory import GiB

MiB = 1024**2

DEFAULT_GPU_OVERHEAD = 1 * GiB
"""Per process on a GPU: CUDA context (~0.5 GiB), cuBLAS and NCCL workspaces, caching-allocator slack."""

DEFAULT_CPU_OVERHEAD = 3 * GiB // 4
"""Per process on the CPU: the Python interpreter with torch and transformers imported."""

HOST_OVERHEAD = 3 * GiB
"""Host RAM per process of a GPU run, beside what it offloads: the interpreter with torch, transformers
and the CUDA runtime's host side (~2 GiB), the tokenizer and data, pinned staging buffers. Loading the
models briefly holds them whole in host memory too: counted apart (plan/host.py)."""

OVERHEAD_ENV = "GPUFLEET_PLAN_OVERHEAD"
"""Setting (not a job field) that overrides the per-process overhead, e.g. `1.5GB` or `512MB`."""


class BadSetting(UserError):
    """An environment setting (not a job field) with a value gpufleet cannot read."""

    def __init__(self, name: str, value: str, why: str, *, fix: str):
        self.name, self.value, self.why = name, value, f"{name}={value!r} {why}."
        super().__init__(self.why, fix=fix)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(g|gb|gib|m|mb|mib)?\s*$", re.I)


def overhead_bytes(env: Mapping[str, str], *, gpu: bool) -> int:
    """Per-process framework overhead: GPUFLEET_PLAN_OVERHEAD (e.g. 1.5GB, 512MB) or the default.

    Raises UserError naming the variable, its value and the fix when it cannot be read.
    """
    raw = env.get(OVERHEAD_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_GPU_OVERHEAD if gpu else DEFAULT_CPU_OVERHEAD
    m = _SIZE.match(raw)
    if not m:
        raise BadSetting(
            OVERHEAD_ENV,
            raw,
            "is not a size (the planner's per-process overhead)",
            fix=f"set it to a size such as {OVERHEAD_ENV}=1.5GB or {OVERHEAD_ENV}=512MB, or unset it",
        )
    unit = (m.group(2) or "g")[0].lower()
    return int(float(m.group(1)) * (GiB if unit == "g" else MiB))
