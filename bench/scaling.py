"""Throughput of 1 vs 2 policy ranks at equal global batch, measured side by side in one run.

    .venv/bin/python bench/scaling.py [--steps 30] [--batch 64]

Runs `gpufleet train examples/quickstart.yaml --gpus cpu` with 1 rank (per_device_batch = batch)
and with 2 ranks (per_device_batch = batch / 2, torchrun + gloo + DDP), and prints completions/s
(median step time after warm-up) and the speed-up. On a 2-core machine both ranks share the two
cores that one process already used (OMP_NUM_THREADS 2 -> 1 each), so the speed-up is bounded by
how much of a step is single-threaded Python/dispatch overhead, minus the all-reduce cost.
No assertions: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(ranks: int, batch: int, steps: int, out: Path, threads: int) -> dict[str, float]:
    argv = [
        sys.executable,
        "-m",
        "gpufleet",
        "train",
        str(ROOT / "examples" / "quickstart.yaml"),
        "--gpus",
        "cpu",
        "--set",
        f"output.dir={out}",
        "--set",
        f"train.max_steps={steps}",
        "--set",
        "output.save_every=0",
        "--set",
        f"train.per_device_batch={batch // ranks}",
        "--set",
        f"launch.nproc_per_node={ranks}",
        "--set",
        "train.log_every=1000",
    ]
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - t0
    times = [json.loads(x)["step_time"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    step = statistics.median(times[min(3, len(times) - 1) :])
    return {"step_time": step, "completions_per_s": batch / step, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        one_all = run(1, args.batch, args.steps, Path(tmp) / "one-all", cores)
        one = run(1, args.batch, args.steps, Path(tmp) / "one", max(cores // 2, 1))
        two = run(2, args.batch, args.steps, Path(tmp) / "two", max(cores // 2, 1))
    print(f"global batch {args.batch} completions, {args.steps} steps, {cores} CPU cores")
    rows = (
        (f"1 rank,  {cores} threads   ", one_all),
        (f"1 rank,  {max(cores // 2, 1)} thread(s)", one),
        (f"2 ranks, {max(cores // 2, 1)} thread(s) each", two),
    )
    for name, r in rows:
        print(
            f"  {name}: {r['completions_per_s']:7.1f} completions/s  (median step {r['step_time'] * 1000:6.1f} ms, "
            f"wall {r['wall']:.1f} s incl. start-up)"
        )
    best_one = max(one_all["completions_per_s"], one["completions_per_s"])
    print(f"  speed-up 2 ranks / best 1 rank: {two['completions_per_s'] / best_one:.2f}x")


if __name__ == "__main__":
    main()
