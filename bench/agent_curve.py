"""Learning curves of one job over several seeds: the installed `gpufleet train`, 1 torch thread a run,
`--parallel` runs at a time, then one table (docs/agents-with-tools.md's): the reward of the first
window, the first step each `--reach` metric's window mean reaches its value (with the training seconds
to it: the sum of `step_time`), and the last window's means.

    .venv/bin/python bench/agent_curve.py examples/agent-tools.yaml --seeds 0,1,2 --steps 800 \\
        --reach rewards/call_shape/mean=0.7 --reach rewards/reads_result/mean=0.5 --reach reward=0.8

A seed whose run in `--out` already reached the steps asked is read, not run again; a shorter one is
resumed by gpufleet (its log appended to). A run that fails is marked in the table, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from stats import mean, steps_to_reach

from gpufleet.monitor.runfiles import read_jsonl

GPUFLEET = Path(sys.executable).with_name("gpufleet")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", help="the job file")
    ap.add_argument("--seeds", default="0,1,2", help="train.seed values")
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the job's)")
    ap.add_argument(
        "--parallel", type=int, default=2, help="runs at a time (default 2: this machine's cores)"
    )
    ap.add_argument("--window", type=int, default=25, help="steps a window (default 25)")
    ap.add_argument(
        "--reach", action="append", default=[], metavar="KEY=VALUE", help="a metric and the value to reach"
    )
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="passed to gpufleet")
    ap.add_argument("--out", default=None, help="work folder (default: a new one under /tmp)")
    ap.add_argument("--read", action="store_true", help="only read the runs in --out (running or not)")
    return ap.parse_args(argv)


def _done(run: Path, steps: int | None) -> bool:
    """Whether the run has finished the steps asked (the job's own max_steps when None)."""
    rows = read_jsonl(run / "metrics.jsonl")
    return (run / "final").exists() and (steps is None or bool(rows) and rows[-1]["step"] >= steps)


def run_all(args: argparse.Namespace, out: Path, seeds: list[int]) -> list[int]:
    """Train every seed not yet done, `--parallel` at a time; the seeds whose run failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    todo = [s for s in seeds if not _done(out / f"seed{s}", args.steps)]
    running: dict[int, subprocess.Popen] = {}
    failed = []
    while todo or running:
        while todo and len(running) < args.parallel:
            seed = todo.pop(0)
            sets = [f"output.dir={out / f'seed{seed}'}", f"train.seed={seed}", *args.set]
            if args.steps is not None:
                sets.append(f"train.max_steps={args.steps}")
            cmd = [str(GPUFLEET), "train", args.job] + [x for s in sets for x in ("--set", s)]
            with open(out / f"seed{seed}.log", "a") as log:  # the child keeps its own copy of the file
                running[seed] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"[agent_curve] seed {seed}: {' '.join(cmd)}", flush=True)
        time.sleep(2)
        for seed, p in [(s, p) for s, p in running.items() if p.poll() is not None]:
            del running[seed]
            if p.returncode:
                failed.append(seed)
                print(f"[agent_curve] seed {seed} failed (exit {p.returncode}): {out / f'seed{seed}.log'}")
    return failed


def table(
    rows_by_seed: dict[int, list[dict]], reach: list[tuple[str, float]], window: int, failed=()
) -> list[str]:
    """The markdown table: per seed, the first window's reward, each reach's step (seconds), the last
    window's reward and reach metrics."""
    head = ["seed", f"reward, steps 1-{window}"]
    head += [f"`{k}` >= {v:g}" for k, v in reach]
    head += [f"reward, last {window}"] + [f"`{k}`, last {window}" for k, _ in reach if k != "reward"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for seed, rows in sorted(rows_by_seed.items()):
        cells = [
            f"{seed} (failed)" if seed in failed else str(seed),
            f"{mean([r['reward'] for r in rows[:window]]):.3f}",
        ]
        for key, value in reach:
            step = steps_to_reach([r.get(key, float("nan")) for r in rows], window, value)
            seconds = sum(r.get("step_time", 0.0) for r in rows[:step]) if step else 0.0
            cells.append(
                f"step {rows[step - 1]['step']} ({seconds:.0f} s)" if step else f"not by {len(rows)}"
            )
        last = rows[-window:]
        cells.append(f"{mean([r['reward'] for r in last]):.3f}")
        cells += [f"{mean([r.get(k, float('nan')) for r in last]):.2f}" for k, _ in reach if k != "reward"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.parallel < 1 or (args.read and not args.out):
        raise SystemExit("agent_curve: --parallel must be >= 1, and --read needs --out (the runs to read)")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out) if args.out else Path(f"/tmp/agent_curve_{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    reach = [(k, float(v)) for k, v in (r.split("=", 1) for r in args.reach)]
    failed = [] if args.read else run_all(args, out, seeds)
    rows_by_seed = {s: rows for s in seeds if (rows := read_jsonl(out / f"seed{s}" / "metrics.jsonl"))}
    print(f"[agent_curve] {args.job}, {args.window}-step windows, seconds = training time (sum of step_time)")
    print("\n".join(table(rows_by_seed, reach, args.window, failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
