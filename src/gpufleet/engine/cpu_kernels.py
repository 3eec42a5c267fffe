"""The matmul of a CPU decode step: a few rows times a weight packed for them (``cpu_kernels.c``).

At 16 rows a decode step's matmuls are bound by reading the weights, and MKL re-packs each weight on
every call: cycling through the 17 weights of the ``small`` benchmark model, ``torch.mm`` ran at 23-37
GFLOP/s here against 47-71 for this kernel (one thread; bench/README.md). The kernel is C with AVX2 and
FMA intrinsics, compiled on first use with the machine's C compiler (``$CC``, else ``cc`` / ``gcc``) into
``$GPUFLEET_CACHE/kernels`` (one file per source and compiler; a concurrent rank's build is replaced
atomically) and loaded with ctypes. Where it cannot be built (no compiler, not x86-64 with AVX2, or
``GPUFLEET_CPU_KERNELS=0``) the fast decoder uses ``torch.mm`` as before; ``unavailable_reason()`` says why.

Results: each output is one sequential fused multiply-add sum over the inner dimension, then + bias, so
it differs from ``torch.mm`` by rounding only (a few 1e-7 relative) and does not depend on the thread
count or on the other rows (bitwise; tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from gpufleet.engine.switches import switched_off
from gpufleet.models.builtin import default_root

__all__ = [
    "ENV",
    "MAX_ROWS",
    "Packed",
    "available",
    "library",
    "matmul",
    "pack",
    "padded",
    "unavailable_reason",
]

ENV = "GPUFLEET_CPU_KERNELS"
"""Set to 0 to use ``torch.mm`` in the fast decoder on CPU instead of this kernel."""

MAX_ROWS = 64
"""Inputs with more rows (a long prefill) take ``torch.mm`` over the model's own weights: MKL's blocked
GEMM reuses a weight over many rows better than this kernel's one pass per 6 rows."""

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_SOURCES = (_SOURCE, _SOURCE.with_name("layer_kernels.c"), _SOURCE.with_name("attention_kernels.c"))
_HEADER = _SOURCE.with_name("simd.h")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
_loaded: dict[str, object] = {}  # "lib": the CDLL, or "reason": why there is none


@dataclass(frozen=True)
class Packed:
    """A weight (out, in) packed for ``matmul``: (ceil(out / 16), in, 16) panels, zero past ``out``."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    """(16 * panels, ) float32, zero-padded like the panels; None: no bias."""
    out_features: int


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of 16: the width of a packed weight's outputs (and of its result)."""
    return -(-n // 16) * 16


def pack(weights: list[torch.Tensor], bias: torch.Tensor | None = None) -> Packed:
    """Pack float32 ``nn.Linear``-layout weights (out_i, in), stacked on their out dimension, and their
    bias (sum out_i,): a copy, same values, in one pass (``gpufleet_pack``)."""
    lib = _library_or_raise()
    out_features, in_features = sum(w.shape[0] for w in weights), weights[0].shape[1]
    width = padded(out_features)
    weights = [w.detach().contiguous() for w in weights]
    panels = torch.empty(width // 16, in_features, 16, dtype=torch.float32)
    pointers = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
    rows = (ctypes.c_long * len(weights))(*(w.shape[0] for w in weights))
    lib.gpufleet_pack(pointers, rows, len(weights), in_features, width, panels.data_ptr())
    if bias is not None:
        bias = torch.cat([bias, bias.new_zeros(width - out_features)])
    return Packed(panels, bias, out_features)


def matmul(x: torch.Tensor, weight: Packed) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 CPU ``x`` (M, in): (M, out), a view of a 16-column-padded result."""
    lib = _library_or_raise()
    if x.stride(-1) != 1:
        x = x.contiguous()
    panels = weight.panels
    out = torch.empty((x.shape[0], panels.shape[0] * 16), dtype=torch.float32)
    lib.gpufleet_gemm(
        x.shape[0],
        x.shape[1],
        panels.shape[0],
        x.data_ptr(),
        x.stride(0),
        panels.data_ptr(),
        None if weight.bias is None else weight.bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out if out.shape[1] == weight.out_features else out[:, : weight.out_features]


def _library_or_raise() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU GEMM kernel is not available: {unavailable_reason()}")
    return lib


def available() -> bool:
    """Whether ``matmul`` runs here (builds and loads the kernel on the first call)."""
    return library() is not None


def unavailable_reason() -> str | None:
    """Why the kernel does not run here, or None when it does."""
    library()
    return _loaded.get("reason")  # type: ignore[return-value]


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on the first call), or None where they cannot run here."""
    if not _loaded:
        try:
            _loaded["lib"] = _load(_build())
        except _Unavailable as exc:
            _loaded["reason"] = str(exc)
    return _loaded.get("lib")  # type: ignore[return-value]


class _Unavailable(Exception):
    """Why the kernel cannot be built or loaded here (one line)."""


def _compiler() -> str:
    if switched_off(ENV):
        raise _Unavailable(f"{ENV}={os.environ[ENV]}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise _Unavailable(f"the CPU is {platform.machine()}, not x86-64")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise _Unavailable(f"the CPU has no AVX2 (torch reports {capability})")
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (found := shutil.which(name)):
            return found
    raise _Unavailable("no C compiler (set CC, or install gcc)")


def _build() -> Path:
    """The compiled kernel's path: built once per source, compiler and flags."""
    compiler = _compiler()
    source = b"".join(p.read_bytes() for p in (*_SOURCES, _HEADER))
    key = hashlib.sha256(source + compiler.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    for folder in (
        default_root() / "kernels",
        Path(tempfile.gettempdir()) / f"gpufleet-kernels-{os.getuid()}",
    ):
        target = folder / f"cpu_kernels-{key}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        errors = []
        for openmp in (("-fopenmp",), ()):  # without OpenMP the kernel runs on one thread
            partial = folder / f".cpu_kernels-{key}.{os.getpid()}.so"
            cmd = [compiler, *_FLAGS, *openmp, "-o", str(partial), *map(str, _SOURCES)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise _Unavailable(f"{compiler} could not build {_SOURCE.name}: {exc}") from None
            if done.returncode == 0:
                os.replace(partial, target)
                return target
            partial.unlink(missing_ok=True)
            errors.append((done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1])
        raise _Unavailable(f"{compiler} could not build {_SOURCE.name}: {errors[-1]}")
    raise _Unavailable("no writable folder for the compiled kernel (GPUFLEET_CACHE, the temp folder)")


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise _Unavailable(f"could not load {path}: {exc}") from None
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.gpufleet_gemm.argtypes = [i, i, i, p, n, p, p, p, n, i]
    lib.gpufleet_gemm.restype = None
    lib.gpufleet_pack.argtypes = [p, p, i, n, n, p]
    lib.gpufleet_pack.restype = None
    lib.gpufleet_decode_step.argtypes = [p]
    lib.gpufleet_decode_step.restype = ctypes.c_int
    lib.gpufleet_sample_prepare.argtypes = [p, n, n, p, n, ctypes.c_float]
    lib.gpufleet_sample_prepare.restype = None
    lib.gpufleet_sample_pick.argtypes = [p, n, n, p, n, p]
    lib.gpufleet_sample_pick.restype = None
    lib.gpufleet_sample_advance.argtypes = [
        p,
        n,
        n,
        p,
        n,
        p,
        n,
        ctypes.c_int64,
        ctypes.c_int64,
        p,
        n,
        p,
        p,
        p,
        p,
    ]
    lib.gpufleet_sample_advance.restype = n
    f = ctypes.c_float
    lib.gpufleet_rms_forward.argtypes = [p, p, f, n, n, p, p, i]
    lib.gpufleet_rms_backward.argtypes = [p, p, p, p, n, n, p, p, p, i]
    lib.gpufleet_swiglu_forward.argtypes = [p, p, n, p, i]
    lib.gpufleet_swiglu_backward.argtypes = [p, p, p, n, p, p, i]
    lib.gpufleet_rope_forward.argtypes = [p, p, p, n, n, n, n, i, p, i]
    lib.gpufleet_rope_backward.argtypes = [p, p, p, n, n, n, n, i, p, i]
    lib.gpufleet_attention_scratch.argtypes = [n, n]
    lib.gpufleet_attention_scratch.restype = n
    lib.gpufleet_attention_forward.argtypes = [p, p, p, p, n, n, n, n, p, f, n, p, p, n, p, i]
    lib.gpufleet_attention_backward.argtypes = [p, p, p, p, p, p, p, n, n, n, n, p, f, n, p, p, p, n, p, i]
    for name in (
        "rms_forward",
        "rms_backward",
        "swiglu_forward",
        "swiglu_backward",
        "rope_forward",
        "rope_backward",
    ):
        getattr(lib, f"gpufleet_{name}").restype = None
    return lib
