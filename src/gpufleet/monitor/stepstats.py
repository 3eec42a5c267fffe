"""The monitoring metrics of one step, over every policy rank: phase timings and peak memory vs plan.

One small all-gather per step (len(PHASES) + 3 numbers per rank), after the step's clock stopped, so
it is not part of `step_time`.
"""

from __future__ import annotations

import torch

from gpufleet.dist import Runtime, all_gather_rows
from gpufleet.monitor.memory import memory_metrics, peak_bytes
from gpufleet.monitor.timing import PHASES, step_timings


def step_stats(rt: Runtime, seconds: dict[str, float], wall: float, planned: int | None) -> dict[str, float]:
    """`timing/*`, `step_time/*` and `memory/*` of this step (see monitor/timing.py, memory.py); `wall`:
    this rank's step time, `planned`: its bytes in the plan (None: no plan)."""
    row = [seconds[k] for k in PHASES] + [wall, float(peak_bytes(rt.device)), float(planned or 0)]
    rows = [r.tolist() for r in all_gather_rows(rt, torch.tensor(row, dtype=torch.float64))]
    n = len(PHASES)
    timings = step_timings([r[:n] for r in rows], [r[n] for r in rows])
    return timings | memory_metrics([(r[n + 1], r[n + 2]) for r in rows])
