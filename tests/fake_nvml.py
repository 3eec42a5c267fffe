"""A stand-in for nvidia-ml-py's `pynvml` module, with recorded answers, for machines without a GPU.

Function names, constants and return shapes are nvidia-ml-py 13.x's (pynvml.py), which gpufleet calls on
a GPU machine through the same seam (`gpufleet.hardware.detect(env, nvml=...)`):

    nvmlDeviceGetMemoryInfo(h)                  -> object with .total .free .used (bytes)
    nvmlDeviceGetComputeRunningProcesses(h)     -> list of objects with .pid .usedGpuMemory (bytes, or None
                                                   under Windows WDDM) .gpuInstanceId .computeInstanceId
    nvmlDeviceGetP2PStatus(h1, h2, p2pIndex)    -> NVML_P2P_STATUS_OK (0) or another NVML_P2P_STATUS_*
    nvmlDeviceGetTopologyCommonAncestor(h1, h2) -> NVML_TOPOLOGY_* (INTERNAL 0 ... SYSTEM 50)
    nvmlDeviceGetName(h)                        -> str (bytes in nvidia-ml-py < 11.515)
    nvmlDeviceGetCudaComputeCapability(h)       -> (major, minor)
    nvmlDeviceGetUtilizationRates(h)            -> object with .gpu .memory (percent over the last sample
                                                   period, ints)
    nvmlDeviceGetPowerUsage(h)                  -> int milliwatts
    nvmlDeviceGetTemperature(h, sensor)         -> int degrees C; sensor NVML_TEMPERATURE_GPU (0)
    errors                                      -> NVMLError subclasses, e.g. NVMLError_NotSupported

Like the real module, NVML_P2P_CAPS_INDEX_READ is the tuple (0,) (pynvml.py writes `= 0,`), and passing
anything but an int as p2pIndex fails as ctypes fails (ctypes.ArgumentError).

The recorded machines: `workstation()` — two GeForce RTX 4090 (24564 MiB, no P2P: their paths meet at
the CPU's host bridge, chipset not supported) and an idle RTX A6000; `a100_node()` — four A100-SXM4-80GB
on NVLink (P2P OK between every pair, whatever their PCIe paths). Each `Gpu` can carry other processes and the memory they hold.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace

MiB = 1024**2

NVML_P2P_CAPS_INDEX_READ = (0,)  # sic: nvidia-ml-py has `NVML_P2P_CAPS_INDEX_READ = 0,`
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED = 1
NVML_P2P_STATUS_GPU_NOT_SUPPORTED = 2
NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = 3
NVML_P2P_STATUS_DISABLED_BY_REGKEY = 4
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_P2P_STATUS_UNKNOWN = 6
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    def __init__(self, value: int, text: str):
        super().__init__(text)
        self.value = value


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    def __init__(self):
        super().__init__(3, "Not Supported")


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's name
    def __init__(self):
        super().__init__(12, "NVML Shared Library Not Found")


@dataclass
class Gpu:
    """One recorded device: what nvidia-smi showed for it."""

    name: str
    total: int
    cc: tuple[int, int]
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    """(pid, used bytes) of other compute processes on it."""
    driver_reserved: int = 430 * MiB  # what an idle card shows as used (driver, ECC, contexts)
    util: tuple[int, int] = (0, 0)  # (gpu %, memory %) as nvmlDeviceGetUtilizationRates says
    power_mw: int = 21000  # an idle card draws about 20 W
    temp_c: int = 34


class FakeNVML:
    """`pynvml` as seen on one machine. `p2p[(i, j)]` / `level[(i, j)]` give NVML's answer for a pair of
    physical indices (unlisted pairs: `p2p_default` / `level_default`); `fail` holds (query, index)
    pairs that raise NVMLError_NotSupported; `init_fails` makes nvmlInit raise as without a driver."""

    def __init__(
        self, gpus, p2p=None, level=None, p2p_default=0, level_default=10, fail=(), init_fails=False
    ):
        self.gpus, self.fail, self.init_fails = list(gpus), set(fail), init_fails
        self.p2p, self.level = dict(p2p or {}), dict(level or {})
        self.p2p_default, self.level_default = p2p_default, level_default
        self.shutdown = 0
        for name, value in globals().items():  # the module's constants, as `pynvml.NVML_...`
            if name.startswith("NVML_"):
                setattr(self, name, value)

    def nvmlInit(self):
        if self.init_fails:
            raise NVMLError_LibraryNotFound()

    def nvmlShutdown(self):
        self.shutdown += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return SimpleNamespace(index=i)  # an opaque c_nvmlDevice_t in the real module

    def _ask(self, what, h):
        if (what, h.index) in self.fail:
            raise NVMLError_NotSupported()
        return self.gpus[h.index]

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h.index}f3c9a1e-55aa-11ee-8c99-0242ac12000{h.index}"

    def nvmlDeviceGetName(self, h):
        return self._ask("name", h).name

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._ask("cc", h).cc

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self._ask("mem", h)
        used = g.driver_reserved + sum(b or 0 for _, b in g.processes)
        return SimpleNamespace(total=g.total, free=g.total - used, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        g = self._ask("procs", h)
        return [
            SimpleNamespace(pid=p, usedGpuMemory=b, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            for p, b in g.processes
        ]

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._ask("util", h)
        return SimpleNamespace(gpu=g.util[0], memory=g.util[1])  # a c_nvmlUtilization_t in the real module

    def nvmlDeviceGetPowerUsage(self, h):
        return self._ask("power", h).power_mw

    def nvmlDeviceGetTemperature(self, h, sensor):
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError_NotSupported()
        return self._ask("temp", h).temp_c

    def _pair(self, table, default, h1, h2):
        key = (min(h1.index, h2.index), max(h1.index, h2.index))
        return table.get(key, default)

    def nvmlDeviceGetP2PStatus(self, h1, h2, p2pIndex):
        if not isinstance(p2pIndex, int):  # the real call passes it to ctypes as a C int
            raise ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert parameter 3")
        self._ask("p2p", h1)
        return self._pair(self.p2p, self.p2p_default, h1, h2)

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        self._ask("topo", h1)
        return self._pair(self.level, self.level_default, h1, h2)


RTX4090 = 24564 * MiB  # 25757220864 bytes: nvidia-smi's "24564MiB"
A6000 = 49140 * MiB
A100_80 = 81920 * MiB


def workstation(busy: dict[int, list[tuple[int, int | None]]] | None = None, **kw) -> FakeNVML:
    """Two GeForce RTX 4090 without P2P (meeting at the host bridge) and an RTX A6000 on another socket."""
    gpus = [
        Gpu("NVIDIA GeForce RTX 4090", RTX4090, (8, 9)),
        Gpu("NVIDIA GeForce RTX 4090", RTX4090, (8, 9)),
        Gpu("NVIDIA RTX A6000", A6000, (8, 6)),
    ]
    for i, procs in (busy or {}).items():
        gpus[i].processes = list(procs)
    kw.setdefault("p2p_default", NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED)
    kw.setdefault("level", {(0, 1): NVML_TOPOLOGY_HOSTBRIDGE})
    kw.setdefault("level_default", NVML_TOPOLOGY_SYSTEM)
    return FakeNVML(gpus, **kw)


def a100_node(**kw) -> FakeNVML:
    """Four A100-SXM4-80GB on NVLink: P2P between every pair (PCIe paths meet within the NUMA node)."""
    gpus = [Gpu("NVIDIA A100-SXM4-80GB", A100_80, (8, 0)) for _ in range(4)]
    return FakeNVML(gpus, p2p_default=NVML_P2P_STATUS_OK, level_default=NVML_TOPOLOGY_NODE, **kw)
