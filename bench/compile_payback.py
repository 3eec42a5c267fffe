"""What `train.torch_compile` costs and gains on a `vs_trl.py` preset, measured side by side (no assertions).

    .venv/bin/python bench/compile_payback.py [--preset small] [--steps 30] [--pairs 2] [--threads 1]

`gpufleet train` (the preset's job, as `vs_trl.py` builds it) runs alternately with
train.torch_compile=false and true, --pairs runs each, interleaved so that both see the same machine
load, each with its own empty TorchInductor cache (a cold compile, as a user's first run). Printed: the
compile's cost (the compiled runs' first step minus the eager runs' first step), the median step time
and its score / backward phases after `--warmup` steps, the saving per step, and after how many steps
the compile has paid for itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gpufleet_run import job_sets
from measure import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def run(p, a: argparse.Namespace, out: Path, compiled: bool) -> list[dict]:
    """One `gpufleet train` process; its metrics.jsonl rows."""
    job = argparse.Namespace(lr=a.lr or p.lr, steps=a.steps, seed=42)
    (out.parent / "job.yaml").write_text("{}\n")  # every field comes from the --set overrides
    argv = [sys.executable, "-m", "gpufleet", "train", str(out.parent / "job.yaml"), "--gpus", "cpu"]
    for s in [*job_sets(job, p, out), f"train.torch_compile={str(compiled).lower()}", "output.save_every=0"]:
        argv += ["--set", s]
    env = os.environ | {
        "OMP_NUM_THREADS": str(a.threads),
        "TORCHINDUCTOR_CACHE_DIR": str(out.parent / f"{out.name}-inductor"),
    }
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def summary(runs: list[list[dict]], warmup: int) -> dict[str, float]:
    """First step (median over runs) and, after `warmup` steps, medians of the step and its phases."""

    def later(key: str) -> float:
        return statistics.median(r[key] for rows in runs for r in rows[warmup:])

    first = statistics.median(rows[0]["step_time"] for rows in runs)
    return {"first": first} | {k: later(k) for k in ("step_time", "timing/score", "timing/backward")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=None)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    work = Path(tempfile.mkdtemp(prefix="gpufleet-compile-"))
    results: dict[bool, list[list[dict]]] = {False: [], True: []}
    for i in range(a.pairs):
        for compiled in (False, True):
            rows = run(p, a, work / f"{'compiled' if compiled else 'eager'}-{i}", compiled)
            results[compiled].append(rows)
            print(
                f"  pair {i} {'compiled' if compiled else 'eager   '}: first step {rows[0]['step_time']:.2f} s",
                flush=True,
            )
    e, c = summary(results[False], a.warmup), summary(results[True], a.warmup)
    cost, saving = c["first"] - e["first"], e["step_time"] - c["step_time"]
    print(
        f"\npreset {p.name}, {a.steps} steps, {a.pairs} pair(s), {a.threads} thread(s); medians after {a.warmup} steps:"
    )
    print("| | eager | compiled | compiled / eager |\n|---|---:|---:|---:|")
    print(f"| first step (compile included) | {e['first']:.2f} s | {c['first']:.2f} s | |")
    for key in ("step_time", "timing/score", "timing/backward"):
        print(f"| {key} | {e[key] * 1000:.0f} ms | {c[key] * 1000:.0f} ms | {c[key] / e[key]:.2f} |")
    pays = f"after {cost / saving:.0f} steps" if saving > 0 else "never (no saving per step)"
    print(
        f"\ncompile cost {cost:.1f} s, saving {saving * 1000:.0f} ms per step: pays back {pays}. Runs: {work}"
    )


if __name__ == "__main__":
    main()
