"""Rank 0's record of every step: metrics.jsonl, the sinks the job asks for (TensorBoard, W&B) and the
advisor's warnings, behind one `write`."""

from __future__ import annotations

from pathlib import Path

from gpufleet.monitor.advisor import Advisor
from gpufleet.monitor.metrics import JsonlWriter
from gpufleet.monitor.sinks import Sinks


class StepLog:
    def __init__(self, job, out: Path, on_gpu: bool, log=print):
        self.jsonl = JsonlWriter(out / "metrics.jsonl")
        self.sinks = Sinks(job, out)
        self.advisor = Advisor(out, job.train.per_device_batch, on_gpu, log)

    def write(self, m: dict[str, float]) -> None:
        self.jsonl.write(m)
        self.sinks.write(m)
        self.advisor.observe(m)

    def close(self) -> None:
        self.jsonl.close()
        self.sinks.close()
