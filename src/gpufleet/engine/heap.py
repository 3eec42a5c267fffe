"""Freed host memory kept for the next step instead of handed back to the kernel (glibc's ``mallopt``).

A training step on the CPU allocates its activations and gradients afresh and frees them at its end.
glibc returns the top of its heap to the kernel once more than a few MB are free there, and hands out
blocks from 128 KiB to 32 MiB with ``mmap`` until its adaptive threshold has grown, so the next step
takes every page again as a page fault the kernel zeroes: on the ``small`` benchmark 4,900-6,800 faults
and 20-28 ms of system time per step (of 800-900 ms). ``keep_freed_memory`` sets the trim threshold
to 256 MiB and the ``mmap`` threshold to 32 MiB (the largest glibc adapts to on its own): the same
steps take 0-4 faults and 0.1 ms of system time, and the peak RSS stays as it was (measured: 554-555
vs 558-564 MiB). Only where the C library is glibc (Linux); ``GPUFLEET_KEEP_FREED=0`` leaves it alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

from gpufleet.engine.switches import switched_off

__all__ = ["ENV", "keep_freed_memory"]

ENV = "GPUFLEET_KEEP_FREED"
"""Set to 0 to leave glibc's malloc settings as they are."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
TRIM_BYTES = 256 << 20
MMAP_BYTES = 32 << 20


def keep_freed_memory() -> bool:
    """Set glibc's trim and ``mmap`` thresholds (see the module docstring); whether they were set."""
    if switched_off(ENV) or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES))
