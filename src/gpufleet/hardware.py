"""Hardware: the devices a job may use, detected (NVML) or described (`--gpus 4x24GB`).

Device numbering follows CUDA: index i is the i-th entry of CUDA_VISIBLE_DEVICES when it is set.
NVML is reached through a small seam (`nvml` argument: any object with the pynvml functions used
here), so tests drive detection with recorded answers. No torch import.

What-if specs (`--gpus`):
    cpu                      the CPU only (device ids then name CPU processes)
    4x24GB                   four GPUs of 24 GiB (GB is read as GiB: a "24 GB" card has 24 GiB)
    2xA100-80GB, 2xV100      a known model, with or without its memory size
    0:24GB,1:24GB,2:16GB     per device, ids 0..n-1 in any order (each may name a model too)
    4x24GB,host=256GB        any of these with the host RAM of each node (without it a GPU spec's host
                             is assumed to have HOST_RAM_PER_GPU_MEMORY x its GPUs' memory)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpufleet.devicestate import GpuProcess, Link, links, processes, query
from gpufleet.errors import UserError

GiB = 1024**3

HOST_RAM_PER_GPU_MEMORY = 2
"""A GPU what-if spec without `host=`: its node is assumed to have this many times its GPUs' memory of
host RAM (common for GPU servers: 4x24GB cards in a 192 GB host; 8x80GB in 1-2 TB)."""

# Known GPU models: name -> (compute capability, bf16 support, default memory in GiB).
GPU_MODELS: dict[str, tuple[float, bool, int]] = {
    "P100": (6.0, False, 16),
    "P40": (6.1, False, 24),
    "1080TI": (6.1, False, 11),
    "V100": (7.0, False, 32),
    "TITANV": (7.0, False, 12),
    "T4": (7.5, False, 16),
    "2080TI": (7.5, False, 11),
    "TITANRTX": (7.5, False, 24),
    "RTX8000": (7.5, False, 48),
    "A100": (8.0, True, 80),
    "A30": (8.0, True, 24),
    "A10": (8.6, True, 24),
    "A10G": (8.6, True, 24),
    "A40": (8.6, True, 48),
    "A6000": (8.6, True, 48),
    "3090": (8.6, True, 24),
    "3090TI": (8.6, True, 24),
    "4090": (8.9, True, 24),
    "L4": (8.9, True, 24),
    "L40": (8.9, True, 48),
    "L40S": (8.9, True, 48),
    "RTX6000ADA": (8.9, True, 48),
    "H100": (9.0, True, 80),
    "H200": (9.0, True, 141),
    "H20": (9.0, True, 96),
    "GH200": (9.0, True, 96),
    "B200": (10.0, True, 180),
    "5090": (12.0, True, 32),
}


@dataclass(frozen=True)
class Device:
    """One accelerator as the job sees it."""

    index: int
    """Index after CUDA_VISIBLE_DEVICES (what placement ids and `cuda:i` mean)."""
    name: str
    total_bytes: int
    free_bytes: int | None = None
    bf16: bool | None = None
    """None when unknown (a spec that names only a size)."""
    compute_capability: float | None = None
    physical: str | None = None
    """The physical id (NVML index or UUID) when CUDA_VISIBLE_DEVICES renumbers."""
    processes: tuple[GpuProcess, ...] = ()
    """Compute processes already on it (detected devices; none for a what-if spec)."""

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    @property
    def visible_id(self) -> str:
        """The id that names this device in CUDA_VISIBLE_DEVICES."""
        return self.physical if self.physical is not None else str(self.index)


@dataclass(frozen=True)
class Hardware:
    """The devices of one node (every node is assumed alike), plus the host CPU and RAM."""

    devices: tuple[Device, ...]
    origin: str
    """`detected`, `spec <text>` or `cpu`."""
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    ram_bytes: int = 0
    """Host RAM of one node: this machine's, what a what-if spec states (`,host=256GB`), or assumed."""
    ram_source: str = "this machine"
    """Where `ram_bytes` comes from: `this machine`, `stated` (--gpus ...,host=) or `assumed` (a GPU
    what-if spec without host=: HOST_RAM_PER_GPU_MEMORY x the GPUs' memory)."""
    links: tuple[Link, ...] = ()
    """P2P between every pair of detected devices (none for a what-if spec: unknown)."""

    @property
    def is_cpu(self) -> bool:
        return not self.devices

    @property
    def is_detected(self) -> bool:
        return self.origin in ("detected", "cpu")

    def free_as_total(self) -> Hardware:
        """The same devices with only their free memory (what a run could use now), where NVML said."""
        devs = tuple(
            replace(d, total_bytes=d.free_bytes) if d.free_bytes is not None else d for d in self.devices
        )
        return replace(self, devices=devs)

    def describe(self) -> str:
        if self.is_cpu:
            return f"CPU only ({self.cpu_count} cores, {self.ram_bytes / GiB:.0f} GiB RAM; {self.origin})"
        names = {d.name for d in self.devices}
        name = names.pop() if len(names) == 1 else "mixed"
        return f"{len(self.devices)} x {name} ({self.origin})"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_hardware(origin: str = "cpu") -> Hardware:
    return Hardware(devices=(), origin=origin, cpu_count=os.cpu_count() or 1, ram_bytes=_ram_bytes())


# --------------------------------------------------------------------------------------- specs

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(g|gb|gib|m|mb|mib|t|tb|tib)$", re.I)
_UNIT = {"g": GiB, "m": 1024**2, "t": 1024**4}


def parse_size(text: str) -> int | None:
    """`24GB` / `512MiB` / `1.5T` -> bytes (G, GB and GiB all mean GiB, as --gpus reads them); None if not a size."""
    m = _SIZE.match(text.strip())
    if not m:
        return None
    return int(float(m.group(1)) * _UNIT[m.group(2)[0].lower()])


def _parse_device_kind(text: str, index: int, spec: str) -> Device:
    """`24GB`, `A100`, `A100-80GB`, `RTX-4090-24GB` -> a Device (raises UserError)."""
    raw = text.strip()
    size = parse_size(raw)
    if size is not None:
        return Device(index, f"{raw.upper()} GPU", size)
    model_part, mem = raw, None
    m = re.match(r"^(.*?)[-_ ]?(\d+(?:\.\d+)?\s*(?:gb|gib|g))$", raw, re.I)
    if m and m.group(1):
        model_part, mem = m.group(1), parse_size(m.group(2))
    key = (
        re.sub(r"[^A-Z0-9]", "", model_part.upper())
        .removeprefix("NVIDIA")
        .removeprefix("RTX")
        .removeprefix("GEFORCE")
    )
    key = key.removeprefix("RTX") if key not in GPU_MODELS else key
    if key not in GPU_MODELS:
        raise UserError(
            f"--gpus {spec!r}: unknown device {raw!r}.",
            fix=f"give a size such as 24GB or a known model ({', '.join(sorted(GPU_MODELS))}), e.g. 4x24GB or 2xA100-80GB.",
        )
    cc, bf16, default_gib = GPU_MODELS[key]
    return Device(index, key, mem if mem else default_gib * GiB, bf16=bf16, compute_capability=cc)


def parse_gpu_spec(spec: str) -> Hardware:
    """Parse a `--gpus` what-if spec (see the module docstring). Raises UserError naming the fix."""
    text, host = _host_part(spec)
    hw = _parse_devices(spec, text)
    if host is not None:
        return replace(hw, ram_bytes=host, ram_source="stated")
    if hw.is_cpu:
        return hw
    gpus = sum(d.total_bytes for d in hw.devices)
    return replace(hw, ram_bytes=HOST_RAM_PER_GPU_MEMORY * gpus, ram_source="assumed")


def _host_part(spec: str) -> tuple[str, int | None]:
    """`4x24GB,host=256GB` -> ("4x24GB", bytes of 256 GiB); no host part: (spec, None)."""
    parts = [p.strip() for p in spec.strip().split(",")]
    hosts = [p for p in parts if p.lower().startswith("host=")]
    if not hosts:
        return spec.strip(), None
    size = parse_size(hosts[-1].split("=", 1)[1])
    if size is None or len(hosts) > 1:
        raise UserError(
            f"--gpus {spec!r}: {', '.join(hosts)} is not one host RAM size.",
            fix="state it once, like 4x24GB,host=256GB",
        )
    return ",".join(p for p in parts if p not in hosts), size


def _parse_devices(spec: str, text: str) -> Hardware:
    if text.lower() == "cpu":
        return cpu_hardware("spec cpu")
    example = "use cpu, 4x24GB, 2xA100-80GB or 0:24GB,1:24GB,2:16GB"
    if not text:
        raise UserError("--gpus is empty.", fix=example)
    if ":" in text:
        devices: dict[int, Device] = {}
        for part in text.split(","):
            idx, colon, kind = part.partition(":")
            if not colon or not idx.strip().isdigit():
                raise UserError(f"--gpus {spec!r}: {part!r} is not id:size.", fix=example)
            i = int(idx)
            if i in devices:
                raise UserError(f"--gpus {spec!r}: device {i} is listed twice.", fix="give each id once.")
            devices[i] = _parse_device_kind(kind, i, spec)
        if sorted(devices) != list(range(len(devices))):
            raise UserError(
                f"--gpus {spec!r}: ids must be 0..{len(devices) - 1}, got {sorted(devices)}.",
                fix="number the devices from 0 without gaps, as CUDA does.",
            )
        devs = tuple(devices[i] for i in range(len(devices)))
    else:
        m = re.match(r"^(\d+)\s*[x*]\s*(.+)$", text, re.I)
        if not m:
            raise UserError(f"--gpus {spec!r} is not a hardware spec.", fix=example)
        count = int(m.group(1))
        if count < 1 or count > 1024:
            raise UserError(
                f"--gpus {spec!r}: {count} devices is out of range.", fix="use 1 to 1024 devices."
            )
        one = _parse_device_kind(m.group(2), 0, spec)
        devs = tuple(
            Device(i, one.name, one.total_bytes, None, one.bf16, one.compute_capability) for i in range(count)
        )
    for d in devs:
        if d.total_bytes < 256 * 1024**2:
            raise UserError(
                f"--gpus {spec!r}: device {d.index} has only {d.total_bytes} bytes.",
                fix="write sizes like 24GB.",
            )
    return Hardware(
        devices=devs, origin=f"spec {text}", cpu_count=os.cpu_count() or 1, ram_bytes=_ram_bytes()
    )


# ------------------------------------------------------------------------------------ detection


def visible_order(env: Mapping[str, str], count: int, uuids: list[str]) -> list[int] | None:
    """Physical indices in CUDA_VISIBLE_DEVICES order (None: unset). CUDA stops at the first invalid entry."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    order: list[int] = []
    for item in (x.strip() for x in raw.split(",")):
        if item.lstrip("-").isdigit():
            i = int(item)
            if i < 0 or i >= count or i in order:
                break
            order.append(i)
        elif item.startswith(("GPU-", "MIG-")):
            hits = [i for i, u in enumerate(uuids) if u.startswith(item)]
            if len(hits) != 1 or hits[0] in order:
                break
            order.append(hits[0])
        else:
            break
    return order


def _load_nvml():
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml


def detect(env: Mapping[str, str] | None = None, nvml=None) -> Hardware:
    """The GPUs this process would see, or the CPU when there are none (or NVML is missing)."""
    env = os.environ if env is None else env
    nvml = _load_nvml() if nvml is None else nvml
    if nvml is None:
        return cpu_hardware()
    try:
        nvml.nvmlInit()
    except Exception:  # NVML raises its own error classes (no driver, no library): no GPU to use
        return cpu_hardware()
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [query(nvml.nvmlDeviceGetUUID, h, fallback="") for h in handles]
        order = visible_order(env, count, uuids)
        physical = list(range(count)) if order is None else order
        devices = [
            _device(nvml, handles[phys], i, phys, order is not None) for i, phys in enumerate(physical)
        ]
        pairs = links(nvml, [handles[phys] for phys in physical])
    finally:
        nvml.nvmlShutdown()
    if not devices:
        return cpu_hardware()
    return Hardware(
        devices=tuple(devices),
        origin="detected",
        cpu_count=os.cpu_count() or 1,
        ram_bytes=_ram_bytes(),
        links=pairs,
    )


def _device(nvml, h, logical: int, phys: int, renumbered: bool) -> Device:
    """One detected device: what NVML answers, unknown where it does not."""
    name = query(nvml.nvmlDeviceGetName, h, fallback="GPU")
    mem = query(nvml.nvmlDeviceGetMemoryInfo, h)
    cc = query(nvml.nvmlDeviceGetCudaComputeCapability, h)
    capability = float(f"{cc[0]}.{cc[1]}") if cc else None
    return Device(
        index=logical,
        name=name.decode() if isinstance(name, bytes) else str(name),
        total_bytes=int(mem.total) if mem is not None else 0,
        free_bytes=int(mem.free) if mem is not None else None,
        bf16=None if capability is None else capability >= 8.0,
        compute_capability=capability,
        physical=str(phys) if renumbered else None,
        processes=processes(nvml, h),
    )


def resolve_hardware(spec: str | None, env: Mapping[str, str] | None = None, nvml=None) -> Hardware:
    """`auto`/None: detect; anything else: a what-if spec."""
    if spec is None or spec.strip().lower() == "auto":
        return detect(env, nvml)
    return parse_gpu_spec(spec)


def hardware_here(gpus: str, env: Mapping[str, str], verb: str, job: str | None = None) -> Hardware:
    """What `train` / `launch` run on: the hardware that is here, `auto` (detect) or `cpu`. A what-if spec
    is refused, naming the command that answers it: for `train`, `plan` / `check` (and --print-launch);
    for `launch`, its --dry-run (a script job has no memory model for plan to use)."""
    if gpus.strip().lower() not in ("auto", "cpu"):
        import shlex

        from gpufleet.errors import UserError

        here = resolve_hardware("auto", env)
        spec, name = shlex.quote(gpus), shlex.quote(job or "JOB")
        dry = f"{name} --dry-run --gpus {spec}" if job else f"--dry-run --gpus {spec} -- CMD"
        ask = (
            f"use `gpufleet launch {dry}` to check it and print the scaled recipe and the command for that "
            "hardware, running nothing"
            if verb == "launch"
            else f"use `gpufleet plan {name} --gpus {spec}` or `gpufleet check {name} --gpus {spec}` to ask "
            f"whether it would fit, or `gpufleet train {name} --gpus {spec} --print-launch` for the command"
        )
        raise UserError(
            f"--gpus {gpus!r}: {verb} runs on the hardware that is here ({here.describe()}), not on a what-if "
            f"spec; {ask}.",
            fix="--gpus auto (detect) or --gpus cpu",
        )
    return resolve_hardware(gpus, env)
