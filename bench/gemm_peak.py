"""This machine's float32 matmul speed at the shapes a GRPO step runs: the peak `vs_trl.py` compares to.

    .venv/bin/python bench/gemm_peak.py                          # the small preset's shapes, 1 thread
    .venv/bin/python bench/gemm_peak.py --preset speed --threads 2
    .venv/bin/python bench/gemm_peak.py --json peak.json         # also write the figures as JSON

Each shape (see flops.gemm_shapes: q/o, k/v, gate/up, down and the output head at the training rows
and at the decode rows, and two weight-gradient shapes), plus a 1024^3 square for reference, is timed
as `torch.matmul(a, b, out=c)` in float32 under `torch.set_num_threads(--threads)`, the setting both
trainers run under. Each shape runs `--trials` trials of enough calls for about 50 ms; the best trial
counts (the one least disturbed by other processes). Two figures per shape: by wall time and by the
process's CPU time (CPU seconds / threads: insensitive to other processes on a shared machine when
every thread is busy). The peak is the best shape's figure; `vs_trl.py` reports each phase's FLOP/s
as a fraction of the CPU-time peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flops import gemm_shapes


def time_matmul(m: int, k: int, n: int, threads: int, trials: int) -> tuple[float, float]:
    """Best (wall, CPU / threads) FLOP/s of an (m, k) x (k, n) float32 matmul."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    c = torch.empty(m, n)
    flops = 2 * m * k * n
    for _ in range(3):
        torch.matmul(a, b, out=c)
    t0 = time.perf_counter()
    torch.matmul(a, b, out=c)
    calls = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-7)))
    best_wall = best_cpu = 0.0
    for _ in range(trials):
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            torch.matmul(a, b, out=c)
        wall, cpu = time.perf_counter() - w0, (time.process_time() - c0) / threads
        best_wall = max(best_wall, flops * calls / wall)
        best_cpu = max(best_cpu, flops * calls / max(cpu, 1e-9))
    return best_wall, best_cpu


def measure(cfg: dict, batch: int, prompt: int, completion: int, threads: int, trials: int) -> dict:
    """Every shape's (wall, CPU) FLOP/s and the peaks; `cfg`: the model's config.json dict."""
    rows = []
    for name, m, k, n in [*gemm_shapes(cfg, batch, prompt, completion), ("square 1024", 1024, 1024, 1024)]:
        wall, cpu = time_matmul(m, k, n, threads, trials)
        rows.append({"name": name, "m": m, "k": k, "n": n, "wall_flops": wall, "cpu_flops": cpu})
    step = [r for r in rows if not r["name"].startswith("square")]
    return {
        "threads": threads,
        "shapes": rows,
        "peak_wall": max(r["wall_flops"] for r in step),
        "peak_cpu": max(r["cpu_flops"] for r in step),
        "square_cpu": rows[-1]["cpu_flops"],
    }


def main() -> None:
    from measure import PRESETS, PROMPT_TOKENS, model_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the figures to this file too")
    a = ap.parse_args()
    p = PRESETS[a.preset]
    r = measure(model_config(p), p.batch, PROMPT_TOKENS, p.completion_tokens, a.threads, a.trials)
    print(
        f"[gemm_peak] preset {p.name}, model {p.model}, torch threads {a.threads}, float32, best of {a.trials}"
    )
    print(f"  {'shape':18s} {'m':>6} {'k':>6} {'n':>6}  {'GFLOP/s (wall)':>15} {'GFLOP/s (CPU)':>14}")
    for s in r["shapes"]:
        print(
            f"  {s['name']:18s} {s['m']:>6} {s['k']:>6} {s['n']:>6}  {s['wall_flops'] / 1e9:>15.1f} {s['cpu_flops'] / 1e9:>14.1f}"
        )
    print(
        f"  peak over the step's shapes: {r['peak_wall'] / 1e9:.1f} GFLOP/s (wall), {r['peak_cpu'] / 1e9:.1f} (CPU time)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(r))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
