"""The `monitor:` section of a job file (what gpufleet records about the run besides metrics.jsonl),
split from schema.py for size; schema.py's `Job` holds it like every other section."""

from __future__ import annotations

from pydantic import Field

from gpufleet.config.types import Section


class MonitorSection(Section):
    """Device sampling, warnings and the sinks metrics also go to (`gpufleet train` and `gpufleet launch`)."""

    device_interval: float = Field(1.0, ge=0)
    """Seconds between two samples of OUTPUT/devices.jsonl, written by a thread of the launcher on each
    node (node N > 0: devices.nodeN.jsonl): per GPU its utilisation, memory used / total, power and
    temperature (NVML) and the ranks on it; per rank (its process tree) CPU% and resident memory, with
    its role. 0: no sampler."""
