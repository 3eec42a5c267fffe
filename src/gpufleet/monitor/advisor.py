"""Rank 0's watcher over the run: every `EVERY` steps, the warnings of monitor/advice.py over the recent
steps and device samples; each kind is said once per run (a line on the console, a record in
OUTPUT/warnings.jsonl that `gpufleet watch` and `gpufleet report` show)."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from gpufleet.monitor import advice
from gpufleet.monitor.memory import read_plan
from gpufleet.monitor.metrics import JsonlWriter
from gpufleet.monitor.runfiles import device_files, merge_nodes

EVERY = 10
"""Steps between two looks (the first after EVERY steps: start-up is not steady state)."""
WINDOW = 20
"""Steps (and their device samples) a look covers."""
WARNINGS_FILE = "warnings.jsonl"


def tail_records(path: Path, since: float, max_bytes: int = 1 << 20) -> list[dict]:
    """The JSONL records of `path` with "t" >= since, read from its last `max_bytes`."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - max_bytes, 0))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("t", 0) >= since:
            out.append(rec)
    return out


class Advisor:
    """Collects each step's metrics (rank 0) and says what the numbers show (see the module docstring)."""

    def __init__(self, out: Path, batch: int, on_gpu: bool, log=print):
        self.out, self.batch, self.on_gpu, self.log = out, batch, on_gpu, log
        self.window: deque[tuple[float, dict]] = deque(maxlen=WINDOW)
        self.said: set[str] = set()
        self.seen = 0
        plan = read_plan(out)
        self.largest = plan.get("largest_per_device_batch")
        first = (plan.get("ranks") or [{}])[0]  # rank 0's: the memory metrics are rank 0's
        self.overhead_gib = first.get("overhead_bytes", 0) / 1024**3

    def observe(self, m: dict) -> list[advice.Advice]:
        """Add one step's metrics (just after the step); the warnings said now."""
        t = time.time() - m["step_time"]
        self.window.append((t, m))
        self.seen += 1
        if self.seen % EVERY:
            return []
        new = [a for a in self.look() if a.kind not in self.said]
        if new:
            writer = JsonlWriter(self.out / WARNINGS_FILE)
            for a in new:
                self.said.add(a.kind)
                self.log(f"warning: {a.text}")
                writer.write({"step": int(m.get("step", 0)), "t": t, "kind": a.kind, "text": a.text})
            writer.close()
        return new

    def look(self) -> list[advice.Advice]:
        steps = [m for _, m in self.window]
        since = self.window[0][0]  # every node's samples (a shared OUTPUT holds each node's file)
        devices = merge_nodes([(n, tail_records(f, since)) for n, f in device_files(self.out)])
        step_time = sum(m["step_time"] for m in steps)
        share = sum(m.get("timing/score", 0.0) for m in steps) / step_time if step_time else None
        found = advice.device_balance(devices, share) + advice.rank_balance(steps)
        if self.on_gpu:
            last = steps[-1]
            found += advice.memory_vs_plan(
                last.get("memory/plan_ratio"),
                last.get("memory/peak_gib", 0.0),
                last.get("memory/plan_gib"),
                self.batch,
                self.largest,
                self.overhead_gib,
            )
        return found
