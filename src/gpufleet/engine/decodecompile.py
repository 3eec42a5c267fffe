"""A decode step's per-layer work around the attention, compiled by ``torch.compile`` on a GPU.

Under the CUDA graph (``graphdecode``) a step's kernels run back to back, but each still takes a few
microseconds however little it does; a layer's elementwise work (the norms' float32 math, RoPE's
multiplies and roll, the split of q/k/v, SwiGLU's ``silu(gate) * up``, the residual adds) is a dozen of
them. ``torch.compile`` (Inductor) fuses each run of elementwise work between two matmuls into one
kernel. Two pieces per layer are compiled, around the attention (which stays as it is: ``gpuattention``'s
Triton kernels, which also write the step's keys and values into the cache; a compiled region would
copy the cache whole to write it):

* ``attention_inputs``: input norm, q/k/v, Qwen3's q/k norms, RoPE;
* ``decode_tail``: output projection, residual, post-attention norm, gate/up, SwiGLU, down, residual.

They are the same functions the eager step runs (``fastdecode_ops``), compiled once per process: the
layers' weights are the compiled functions' inputs (Dynamo guards on their shapes, not on which layer
they are), so one compilation serves every layer of every rollout of a model. The first step of a
rollout runs eagerly before its graph is captured, so the compilation happens there, never during a
capture. A compilation that fails turns this off for the process with a warning (the step runs the
plain functions). ``GPUFLEET_DECODE_COMPILE=0`` turns it off.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from gpufleet.engine.fastdecode_ops import attention_inputs, decode_tail
from gpufleet.engine.switches import switched_off

__all__ = ["COMPILE_ENV", "pieces", "usable"]

COMPILE_ENV = "GPUFLEET_DECODE_COMPILE"
"""Set to 0 to run the decode step's per-layer elementwise work unfused (no ``torch.compile``)."""

_failed: list[str] = []
"""Why a compilation failed in this process (then the plain functions run)."""

_compiled: dict[str, Callable] = {}


def usable(device: torch.device) -> bool:
    """On a CUDA device, unless ``GPUFLEET_DECODE_COMPILE=0`` or a compilation failed in this process."""
    return device.type == "cuda" and not switched_off(COMPILE_ENV) and not _failed


def _guarded(name: str, plain: Callable) -> Callable:
    """``plain`` compiled, falling back to ``plain`` (for good, with a warning) if compiling fails."""
    compiled = torch.compile(plain, fullgraph=True)

    def run(*args):
        if _failed:
            return plain(*args)
        try:
            return compiled(*args)
        except Exception as error:  # noqa: BLE001 - any compiler failure: run the plain code
            _failed.append(f"{name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            warnings.warn(
                f"gpufleet: the decode step's {name} could not be compiled ({_failed[0]}); it runs "
                f"unfused (set {COMPILE_ENV}=0 to skip trying)",
                RuntimeWarning,
                stacklevel=2,
            )
            return plain(*args)

    return run


def pieces(device: torch.device, force: bool = False) -> tuple[Callable, Callable]:
    """(``attention_inputs``, ``decode_tail``): compiled where ``usable`` (or ``force``: the tests, on
    the CPU), else the plain functions."""
    if not (force or usable(device)):
        return attention_inputs, decode_tail
    if not _compiled:
        _compiled["pre"] = _guarded("attention inputs", attention_inputs)
        _compiled["tail"] = _guarded("layer tail", decode_tail)
    return _compiled["pre"], _compiled["tail"]
