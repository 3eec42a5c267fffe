"""`gpufleet launch --scaling 1,2,4`: throughput per process count from the progress lines rank 0 printed
(timestamped by rankexec into logs/progress.jsonl), the speed-up over the first count and the efficiency.
Pure arithmetic; the runs themselves are the launch verb's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    t: float
    samples: int


def read_points(path: Path) -> list[Point]:
    points = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
            points.append(Point(float(rec["t"]), int(rec["samples"])))
        except (ValueError, KeyError, TypeError):
            continue
    return points


def throughput(points: list[Point]) -> float | None:
    """Samples per second between the first and the last report (the first report marks the end of the
    start-up: imports, model, first step); None with fewer than two reports or no time between them."""
    if len(points) < 2 or points[-1].t <= points[0].t:
        return None
    return (points[-1].samples - points[0].samples) / (points[-1].t - points[0].t)


def table(rows: list[tuple[int, float | None]]) -> str:
    """processes | samples/s | speed-up | efficiency, relative to the first row."""
    base_n, base = rows[0]
    lines = ["  processes   samples/s   speed-up   efficiency"]
    for n, rate in rows:
        if rate is None:
            lines.append(f"  {n:>9}   {'-':>9}   {'-':>8}   {'-':>10}   (fewer than 2 progress lines)")
            continue
        speedup = rate / base if base else None
        eff = speedup / (n / base_n) if speedup is not None else None
        lines.append(
            f"  {n:>9}   {rate:>9.1f}   {_x(speedup):>8}   {'-' if eff is None else f'{eff:.0%}':>10}"
        )
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
