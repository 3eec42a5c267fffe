"""This machine's float32 matmul speed at the shapes a GRPO step runs: the peak `vs_trl.py` compares to.

    .venv/bin/python bench/gemm_peak.py                          # the small preset's shapes, 1 thread
    .venv/bin/python bench/gemm_peak.py --preset speed --threads 2
    .venv/bin/python bench/gemm_peak.py --json peak.json         # also write the figures as JSON
    python3 bench/gemm_peak.py --preset gpu --device cuda --dtype bfloat16   # a GPU's rate at a 0.5B model's shapes

Each shape (see flops.gemm_shapes: q/o, k/v, gate/up, down and the output head at the training rows
and at the decode rows, and two weight-gradient shapes), plus a 1024^3 square for reference (8192^3 on
a GPU), is timed as `torch.matmul(a, b, out=c)` in `--dtype` (float32 by default) under
`torch.set_num_threads(--threads)`, the setting both trainers run under. Each shape runs `--trials` trials of enough calls for about 50 ms; the best trial
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


def time_matmul(
    m: int, k: int, n: int, threads: int, trials: int, device: str = "cpu", dtype: str = "float32"
) -> tuple[float, float]:
    """Best (wall, CPU / threads) FLOP/s of an (m, k) x (k, n) matmul. On a GPU both figures are the
    GPU's (timed between synchronizations: the CPU time of a launching thread means nothing there)."""
    import torch

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(0)
    kw = {"device": device, "dtype": getattr(torch, dtype)}
    a, b = torch.randn(m, k, generator=g).to(**kw), torch.randn(k, n, generator=g).to(**kw)
    c = torch.empty(m, n, **kw)
    flops = 2 * m * k * n
    for _ in range(3):
        torch.matmul(a, b, out=c)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b, out=c)
    sync()
    calls = max(10, int(0.05 / max((time.perf_counter() - t0) / 10, 1e-7)))
    best_wall = best_cpu = 0.0
    for _ in range(trials):
        sync()
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            torch.matmul(a, b, out=c)
        sync()
        wall, cpu = time.perf_counter() - w0, (time.process_time() - c0) / threads
        best_wall = max(best_wall, flops * calls / wall)
        best_cpu = best_wall if cuda else max(best_cpu, flops * calls / max(cpu, 1e-9))
    return best_wall, best_cpu


def measure(
    cfg: dict,
    batch: int,
    prompt: int,
    completion: int,
    threads: int,
    trials: int,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """Every shape's (wall, CPU) FLOP/s and the peaks; `cfg`: the model's config.json dict."""
    rows = []
    square = 8192 if device == "cuda" else 1024
    shapes = [*gemm_shapes(cfg, batch, prompt, completion), (f"square {square}", square, square, square)]
    for name, m, k, n in shapes:
        wall, cpu = time_matmul(m, k, n, threads, trials, device, dtype)
        rows.append({"name": name, "m": m, "k": k, "n": n, "wall_flops": wall, "cpu_flops": cpu})
    step = [r for r in rows if not r["name"].startswith("square")]
    return {
        "threads": threads,
        "device": device,
        "dtype": dtype,
        "shapes": rows,
        "peak_wall": max(r["wall_flops"] for r in step),
        "peak_cpu": max(r["cpu_flops"] for r in step),
        "square_cpu": rows[-1]["cpu_flops"],
        "square": square,
    }


def main() -> None:
    from measure import PRESETS, PROMPT_TOKENS, model_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the figures to this file too")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args()
    p = PRESETS[a.preset]
    cfg = model_config(p)
    r = measure(cfg, p.batch, PROMPT_TOKENS, p.completion_tokens, a.threads, a.trials, a.device, a.dtype)
    print(
        f"[gemm_peak] preset {p.name}, model {p.model}, {a.device}, torch threads {a.threads}, {a.dtype}, best of {a.trials}"
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
