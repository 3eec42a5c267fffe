"""The `monitor:` section of a job file (what gpufleet records about the run besides metrics.jsonl),
split from schema.py for size; schema.py's `Job` holds it like every other section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpufleet.config.types import Section


class MonitorSection(Section):
    """Device sampling, warnings and the sinks metrics also go to (`gpufleet train` and `gpufleet launch`)."""

    device_interval: float = Field(1.0, ge=0)
    """Seconds between two samples of OUTPUT/devices.jsonl, written by a thread of the launcher on each
    node (node N > 0: devices.nodeN.jsonl): per GPU its utilisation, memory used / total, power and
    temperature (NVML) and the ranks on it; per rank (its process tree) CPU% and resident memory, with
    its role. 0: no sampler."""

    tensorboard: bool = False
    """Also write every step's metrics (the names of metrics.jsonl) as TensorBoard events in
    OUTPUT/tensorboard (`tensorboard --logdir OUTPUT/tensorboard`). Needs the extra:
    `pip install 'gpufleet[tensorboard]'`."""

    wandb: bool = False
    """Also log every step's metrics (the names of metrics.jsonl) and the resolved job to Weights & Biases,
    files under OUTPUT/wandb. Needs the extra: `pip install 'gpufleet[wandb]'`."""

    wandb_project: str = "gpufleet"
    """The W&B project of the run (its name is OUTPUT's folder name)."""

    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """`offline`: no network, the run is kept in OUTPUT/wandb for `wandb sync` later; `online` needs
    `wandb login` (or WANDB_API_KEY)."""
