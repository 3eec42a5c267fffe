"""What NVML says about GPUs beyond their size: the compute processes already on them, and whether two
of them can read each other's memory directly (peer-to-peer, P2P) and where their PCIe/NVLink paths meet.

Reached through the seam of `gpufleet.hardware.detect` (`nvml`: any object with nvidia-ml-py's `pynvml`
functions and constants), so tests drive it with recorded answers (tests/fake_nvml.py). A query NVML
cannot answer (NVMLError_NotSupported, no permission) leaves its answer unknown, never fatal.
No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# nvidia-ml-py's names of the P2P statuses (NVML_P2P_STATUS_*) and topology levels (NVML_TOPOLOGY_*).
_STATUS_WORDS = {
    "NVML_P2P_STATUS_OK": "supported",
    "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED": "the chipset does not support it",
    "NVML_P2P_STATUS_GPU_NOT_SUPPORTED": "the GPU does not support it",
    "NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED": "the I/O hub topology does not support it",
    "NVML_P2P_STATUS_DISABLED_BY_REGKEY": "disabled by a driver registry key",
    "NVML_P2P_STATUS_NOT_SUPPORTED": "not supported",
    "NVML_P2P_STATUS_UNKNOWN": "unknown",
}
_LEVEL_WORDS = {
    "NVML_TOPOLOGY_INTERNAL": "on the same board",
    "NVML_TOPOLOGY_SINGLE": "through one PCIe switch",
    "NVML_TOPOLOGY_MULTIPLE": "through several PCIe switches",
    "NVML_TOPOLOGY_HOSTBRIDGE": "at a CPU's PCIe host bridge",
    "NVML_TOPOLOGY_NODE": "across host bridges of one NUMA node",
    "NVML_TOPOLOGY_SYSTEM": "across CPU sockets",
}


@dataclass(frozen=True)
class GpuProcess:
    """A compute process NVML sees on a device."""

    pid: int
    """As the driver sees it: in a container this may be the host's pid, not one visible here."""
    used_bytes: int | None
    """GPU memory it holds; None where NVML cannot say (Windows WDDM, no permission)."""


@dataclass(frozen=True)
class Link:
    """How two devices (logical ids a < b, as numbered after CUDA_VISIBLE_DEVICES) reach each other."""

    a: int
    b: int
    p2p: bool | None
    """Both can read the other's memory directly (NVML's P2P read status OK both ways); False when either
    way is not; None: unknown (NVML answered neither way, or only OK one way)."""
    status: str
    """NVML's reason in words (`the chipset does not support it`, ...)."""
    path: str | None = None
    """Where their paths meet (`at a CPU's PCIe host bridge`, ...); None: unknown."""


def query(fn: Callable[..., Any], *args: Any, fallback: Any = None) -> Any:
    """One NVML query; a failing one (NVMLError_NotSupported, NVMLError_NoPermission, ...) yields `fallback`."""
    try:
        return fn(*args)
    except Exception:  # NVML raises one error class per return code: report what is known, no more
        return fallback


def processes(nvml, handle) -> tuple[GpuProcess, ...]:
    """The compute processes on a device (none when NVML cannot list them)."""
    found = query(nvml.nvmlDeviceGetComputeRunningProcesses, handle, fallback=[]) or []
    return tuple(
        GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in found
    )


def _read_index(nvml) -> int:
    """NVML_P2P_CAPS_INDEX_READ as the C int NVML takes. nvidia-ml-py (12.x, 13.x) defines it as `0,` — a
    one-element tuple — which its own ctypes call refuses, so unwrap it."""
    value = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    return int(value[0] if isinstance(value, tuple) else value)


def _words(nvml, table: dict[str, str]) -> dict[int, str]:
    return {getattr(nvml, name): word for name, word in table.items() if hasattr(nvml, name)}


def links(nvml, handles: Sequence[Any]) -> tuple[Link, ...]:
    """P2P (read, both directions) and the common ancestor of every pair of `handles` (logical order)."""
    index, ok = _read_index(nvml), getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    statuses, levels = _words(nvml, _STATUS_WORDS), _words(nvml, _LEVEL_WORDS)
    out = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            ha, hb = handles[a], handles[b]
            both = [query(nvml.nvmlDeviceGetP2PStatus, x, y, index) for x, y in ((ha, hb), (hb, ha))]
            level = query(nvml.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
            known = [s for s in both if s is not None]
            p2p = False if any(s != ok for s in known) else (True if len(known) == 2 else None)
            bad = next((s for s in known if s != ok), ok if known else None)
            status = "unknown (NVML did not answer)" if bad is None else statuses.get(bad, f"status {bad}")
            out.append(Link(a, b, p2p, status, levels.get(level) if level is not None else None))
    return tuple(out)
