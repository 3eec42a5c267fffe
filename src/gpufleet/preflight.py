"""Before a run starts: what the chosen GPUs say now (NVML, through `gpufleet.hardware.detect`) — too
little free memory for what the job needs, other processes already on them, no peer-to-peer path
between them. Pure functions of a `Hardware` and the chosen device ids, shared by `gpufleet launch`,
`train` and `check`. No torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpufleet.config.problems import FieldRef, Problem
from gpufleet.hardware import Device, GiB, Hardware
from gpufleet.text import plural

P2P_VARIABLE = "NCCL_P2P_DISABLE"


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def _available(d: Device) -> int:
    """Bytes a run could use on `d` now: its free memory where NVML said, else the whole card."""
    return d.free_bytes if d.free_bytes is not None else d.total_bytes


def _held(d: Device) -> str:
    """`pid 4145 (9.0 GiB), pid 4188 (memory not reported)`."""
    said = [
        ("memory not reported" if p.used_bytes is None else f"{gib(p.used_bytes)} GiB") for p in d.processes
    ]
    return ", ".join(f"pid {p.pid} ({what})" for p, what in zip(d.processes, said, strict=True))


def with_room(hw: Hardware, need: int = 0) -> list[Device]:
    """The devices no other process uses that have `need` bytes available."""
    return [d for d in hw.devices if not d.processes and _available(d) >= need]


def room_elsewhere(hw: Hardware, count: int, need: int = 0) -> str | None:
    """`CUDA_VISIBLE_DEVICES=2,3`: `count` devices `with_room` (None when there are not that many)."""
    ok = with_room(hw, need)
    if count < 1 or len(ok) < count:
        return None
    return "CUDA_VISIBLE_DEVICES=" + ",".join(d.visible_id for d in ok[:count])


def short_of_memory(hw: Hardware, need: Mapping[int, int], refs: list[FieldRef], fix: str) -> list[Problem]:
    """An error for each chosen device (id -> bytes needed on it) that has less available (free memory
    by NVML; the whole card for a what-if spec). Tagged rule `fit`, which `train --force` may override."""
    out = []
    for i, bytes_needed in need.items():
        d = hw.devices[i] if 0 <= i < len(hw.devices) else None
        if d is None or not _available(d) or _available(d) >= bytes_needed:
            continue  # no such device (topology rules say so), size unknown, or room enough
        if d.free_bytes is None:
            has = f"has {gib(d.total_bytes)} GiB"
        else:
            others = f"; in use by {_held(d)}" if d.processes else ""
            has = f"has {gib(d.free_bytes)} GiB free of {gib(d.total_bytes)} GiB{others}"
        why = f"device {i} ({d.name}) {has}, but the job needs {gib(bytes_needed)} GiB on it."
        out.append(Problem("error", refs, why, fix, extra={"rule": "fit"}))
    return out


def busy(hw: Hardware, ids: Iterable[int], refs: list[FieldRef]) -> list[Problem]:
    """A warning for each chosen device that other processes already use (NVML's compute processes)."""
    ids = [i for i in ids if 0 <= i < len(hw.devices)]
    idle = room_elsewhere(hw, len(ids))
    fix = "stop them or wait for them (nvidia-smi lists them)" + (
        f", or run on idle devices: {idle} gpufleet ..." if idle else ""
    )
    out = []
    for i in ids:
        d = hw.devices[i]
        if d.processes:
            why = (
                f"device {i} ({d.name}) is already used by {plural(len(d.processes), 'other process', 'other processes')}: "
                f"{_held(d)}; they compete for its memory and time."
            )
            out.append(Problem("warning", refs, why, fix))
    return out


def p2p_env(hw: Hardware, ids: Iterable[int], env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """Where NVML says two chosen GPUs have no peer-to-peer access (consumer cards, some PCIe topologies):
    ({NCCL_P2P_DISABLE: 1}, the one line that says so). Nothing when every pair has it, when it is not
    known, or when the user set NCCL_P2P_DISABLE already (their choice stands)."""
    chosen = set(ids)
    blocked = [x for x in hw.links if x.a in chosen and x.b in chosen and x.p2p is False]
    if not blocked or P2P_VARIABLE in env:
        return {}, None
    pairs = ", ".join(f"{x.a}-{x.b}" for x in blocked)
    first = blocked[0]
    where = f"; their paths meet {first.path}" if first.path else ""
    note = (
        f"nccl: GPUs {pairs} have no peer-to-peer access (NVML: {first.status}{where}): "
        f"gpufleet sets {P2P_VARIABLE}=1 for the ranks (set {P2P_VARIABLE} yourself to decide)"
    )
    return {P2P_VARIABLE: "1"}, note
