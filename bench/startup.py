"""Wall time of `gpufleet check` / `config` as whole processes (the user's view), no assertions.

    .venv/bin/python bench/startup.py [--runs 10]

Prints the median and best of N runs of each command, and the time of `python -c pass` for scale.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "examples" / "quickstart.yaml")

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "gpufleet check (cpu)": [sys.executable, "-m", "gpufleet", "check", JOB, "--gpus", "cpu"],
    "gpufleet check (4x24GB)": [sys.executable, "-m", "gpufleet", "check", JOB, "--gpus", "4x24GB"],
    "gpufleet config": [sys.executable, "-m", "gpufleet", "config", JOB],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    for name, cmd in COMMANDS.items():
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, check=False)
            times.append(time.perf_counter() - t0)
        print(
            f"{name:28s} median {statistics.median(times) * 1000:7.1f} ms   best {min(times) * 1000:7.1f} ms"
        )


if __name__ == "__main__":
    main()
