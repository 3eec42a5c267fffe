"""Metrics sinks: one JSON object per step in metrics.jsonl, samples.jsonl, and a progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class JsonlWriter:
    """Append-only JSONL file, flushed after each record (a crash loses at most the line being written)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(record, default=_plain) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else str(v)


def fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One line per logged step: step/total, reward, KL, completion length, s/step and ETA. The s/step is the
    mean over the steps since the start (checkpoints and logging included), the rate the ETA uses: the last
    step alone said 0.78 s/step after 20 steps that took 109 s."""

    def __init__(self, total: int, start: int = 0, out: TextIO | None = None):
        self.total, self.start, self.out = total, start, out or sys.stdout
        self.t0 = time.perf_counter()

    def line(self, step: int, m: dict[str, float]) -> str:
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        per_step = elapsed / done if done else m["step_time"]
        eta = per_step * (self.total - step) if done else math.inf
        width = len(str(self.total))
        return (
            f"step {step:>{width}}/{self.total}  reward {m['reward']:.3f} (sd {m['reward_std']:.3f})  "
            f"kl {m['kl']:.4f}  len {m['completions/mean_length']:.1f}  loss {m['loss']:+.4f}  "
            f"{per_step:.2f}s/step  elapsed {fmt_time(elapsed)}  eta {fmt_time(eta)}"
        )

    def print(self, step: int, m: dict[str, float]) -> None:
        print(self.line(step, m), file=self.out, flush=True)
