"""gpufleet's trainer vs TRL 1.16 `GRPOTrainer` on identical settings, side by side in one run.

    .venv/bin/python bench/vs_trl.py                       # preset speed: 40 steps x seeds 42,43,44, 1 torch thread
    .venv/bin/python bench/vs_trl.py --steps 20 --seeds 0 --lr 3e-3 --threads 2
    .venv/bin/python bench/vs_trl.py --preset learn        # 200 steps at the quickstart's first settings; both learn
    python3 bench/vs_trl.py --preset gpu --device cuda --here --threads 8   # a GPU machine with TRL installed

TRL is not a dependency of gpufleet. The first run creates `.bench-venv/` at the repository root (once,
reused afterwards) with `torch==2.13.0 trl==1.16.0 accelerate==1.15.0` and gpufleet's own dependencies
pinned by `constraints.txt`, then re-executes itself there; gpufleet is imported from `src/` through
PYTHONPATH (no install). Nothing is installed into `.venv`.

Each training run is a separate subprocess (so peak RSS, `ru_maxrss`, is per trainer); the two trainers
alternate seed by seed. Settings shared by both: `builtin:tiny-qwen2` (fp32, weights read from the same
materialized folder), task `builtin:repeat` (the same prompts in the same order, reward `repeat/chars`),
8 completions per step (2 prompts x 4 generations), 32 completion tokens, temperature 1.0, top_p 1,
top_k 0, beta 0 (no reference model), loss_type grpo, token-level ratio, clip 0.2, group std scaling,
one optimizer step per generation batch, AdamW with a constant learning rate, max_grad_norm 1.0, the
same torch thread count (the numbers are those of `--preset speed`; see measure.PRESETS). TRL gets its fastest fair settings: no gradient checkpointing, no bf16, no
reporting, no checkpoints, no progress bar, data loader workers 0.

Measured: end-to-end step time (time between consecutive step ends, median after a warm-up), CPU
time of the process per step (insensitive to other processes on a shared machine; with --threads > 1
it counts every thread's core-seconds), completions/s, peak RSS, time to the first step, the whole
run's wall time, start-up time (`python -m gpufleet --version` vs `python -c "import trl"` and
friends), and both reward curves. Prints a summary block for the README at the end. No assertions on
time. `--src DIR` benchmarks another gpufleet source tree (e.g. `git archive HEAD src | tar -x -C DIR`).

Presets (`--preset`): `speed` (the default) is the issue's speed measurement: 8 completions per step
(2 prompts x 4 generations), 32 completion tokens, 40 steps; at that batch neither trainer learns
`repeat`. `learn` is the quickstart's first settings (budget 8, `repeat/chars`): 128 completions per step (16 prompts x 8 generations),
8 completion tokens, lr 3e-3, 200 steps (`--steps` changes it); both trainers learn, and the summary
adds a per-seed comparison of the learning curves: the area under the curve (mean reward over all
steps), the first step whose 10-step moving average reaches 0.8, and the difference of the AUCs with
a Welch t statistic and a bootstrap confidence interval (no scipy needed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpufleet_run
import trl_run
from benchvenv import BENCH, ROOT, SRC, child_env, in_bench_venv, reexec_in_bench_venv
from measure import PRESETS, Preset, measure_startup
from stats import MA_TARGET, auc, mean, med, steps_to_reach
from summary import hardware, report, seeds_text, versions

# Files: benchvenv.py (.bench-venv and the children's environment), gpufleet_run.py and trl_run.py (one
# training run of each side, in a child process), measure.py (presets, step clock, result files, start-up
# timings), stats.py (pure statistics), summary.py (reward table and summary block). This file: the CLI,
# the runs seed by seed, one line per run.


def run_worker(kind: str, seed: int, a: argparse.Namespace, work: Path) -> dict:
    """Run one trainer for one seed as a child process; its result file plus wall time and load."""
    out = work / f"{kind}-seed{seed}"
    result = work / f"{kind}-seed{seed}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--seed", str(seed)]
    cmd += ["--preset", a.preset, "--steps", str(a.steps), "--lr", repr(a.lr), "--threads", str(a.threads)]
    cmd += ["--device", a.device, "--precision", a.precision, "--out", str(out), "--result", str(result)]
    cmd += ["--torch-compile"] if a.torch_compile else []
    log = work / f"{kind}-seed{seed}.log"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with log.open("w") as f:
        env = child_env(a.threads, a.src)
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"[vs_trl] {kind} seed {seed} failed (exit {rc}); log {log}:\n{tail}")
    r = json.loads(result.read_text())
    if a.device == "cuda":  # a 0.5B model's checkpoint and final weights: GBs per run, all read already
        shutil.rmtree(out, ignore_errors=True)
    r["process_s"] = time.perf_counter() - t0 - r.get("peak_s", 0.0)  # the training process alone
    r["load_before"] = load
    r["load_after"] = os.getloadavg()[0]
    return r


def print_run(kind: str, seed: int, r: dict, warmup: int) -> None:
    w = r["step_time"][warmup:]
    print(
        f"  {kind:8s} seed {seed}: median step {med(w) * 1000:6.0f} ms (cpu {med(r['cpu_step_time'][warmup:]) * 1000:5.0f} ms)"
        f"  AUC {auc(r['reward']):.3f}  last-10 reward {mean(r['reward'][-10:]):.3f}"
        f"  reach {MA_TARGET:g} @ {steps_to_reach(r['reward']) or '-'}  peak RSS {r['peak_rss_mib']:.0f} MiB"
        f"  run {r['process_s']:.1f} s  (load {r['load_before']:.2f} -> {r['load_after']:.2f})",
        flush=True,
    )


def orchestrate(a: argparse.Namespace, p: Preset) -> None:
    """Materialize the model, time the start-ups, run both trainers seed by seed, print the summary."""
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpufleet-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] {versions()}; {hardware(a)}; {a.device}; torch threads {a.threads} (both)")
    print(
        f"[vs_trl] preset {p.name}: {p.batch} completions/step ({p.batch // p.generations} prompts x {p.generations} generations), "
        f"{p.completion_tokens} completion tokens, lr {a.lr:g}, {a.steps} steps, seeds {seeds_text(a)}"
    )
    print(
        f"[vs_trl] gpufleet from {a.src}; work dir {work}; load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    env = child_env(a.threads, a.src)
    # Materialize the model once, up front, so neither trainer pays for building it.
    materialize = f"from measure import PRESETS, model_folder; model_folder(PRESETS[{p.name!r}])"
    subprocess.run([sys.executable, "-c", materialize], env=env, cwd=BENCH, check=True)
    peak_file = work / "gemm_peak.json"
    gemm = [sys.executable, str(BENCH / "gemm_peak.py"), "--preset", p.name, "--threads", str(a.threads)]
    gemm += ["--device", a.device, "--dtype", "bfloat16" if a.precision == "bf16" else "float32"]
    subprocess.run([*gemm, "--json", str(peak_file)], env=env, cwd=BENCH, check=True)
    peak = json.loads(peak_file.read_text())

    startup = measure_startup(a.startup_runs, env, ROOT) if a.startup_runs > 0 else {}
    for name, ts in startup.items():
        print(f"  start-up  {name:42s} median {med(ts) * 1000:7.0f} ms   best {min(ts) * 1000:7.0f} ms")

    results: dict[str, list[dict]] = {"gpufleet": [], "trl": []}
    loads: list[float] = [os.getloadavg()[0]]
    for i, seed in enumerate(a.seeds):
        order = ("gpufleet", "trl") if i % 2 == 0 else ("trl", "gpufleet")  # alternate who goes first
        for kind in order:
            r = run_worker(kind, seed, a, work)
            results[kind].append(r)
            loads.append(r["load_after"])
            print_run(kind, seed, r, a.warmup)
    (work / "results.json").write_text(json.dumps({"startup": startup, "runs": results}, indent=1))
    report(a, p, results, startup, loads, work, peak)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="speed",
        help="shared settings: speed (default; tiny-qwen2, 8 completions/step, 32 tokens, 40 steps), small "
        "(a 3.2M-parameter Qwen2, 16 completions/step, G 8, 64 tokens, beta 0.04, 20 steps), learn "
        "(the quickstart's first settings: 16 prompts x 8 generations, 8 tokens, 200 steps) or gpu (the "
        "small preset's batch on Qwen2.5-0.5B's shapes, 10 steps; with --device cuda)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per run (default: the preset's, 40 / 20 / 200)",
    )
    ap.add_argument(
        "--seeds",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[42, 43, 44],
        help="comma-separated seeds; each trainer runs once per seed (default 42,43,44)",
    )
    ap.add_argument(
        "--lr", type=float, default=None, help="learning rate of both (default 3e-3, as the quickstart)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads in both trainers (default 1)"
    )
    ap.add_argument(
        "--warmup", type=int, default=5, help="steps left out of the step-time medians (default 5)"
    )
    ap.add_argument(
        "--every",
        type=int,
        default=None,
        help="print the reward table every k steps (default: 5 / 10 by preset)",
    )
    ap.add_argument("--startup-runs", type=int, default=5, help="runs of each start-up command (0 = skip)")
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where both trainers run (default cpu)"
    )
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32 (default), or bf16 autocast over fp32 weights in both (gpufleet train.precision, TRL bf16)",
    )
    ap.add_argument(
        "--torch-compile",
        action="store_true",
        help="gpufleet with train.torch_compile=true (each decoder layer compiled for the training and scoring "
        "forwards); TRL as it is (its torch_compile compiles the model its generate calls too)",
    )
    ap.add_argument(
        "--here",
        action="store_true",
        help="run under this interpreter (its torch, transformers, TRL) instead of .bench-venv: a GPU "
        "machine without network access",
    )
    ap.add_argument(
        "--out", default=None, help="work dir for runs, logs, results.json (default: a new /tmp dir)"
    )
    ap.add_argument(
        "--src",
        default=None,
        help="gpufleet source folder to benchmark (default: this checkout's src/; e.g. a `git archive` snapshot)",
    )
    ap.add_argument("--worker", choices=("gpufleet", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    for key in ("steps", "lr", "every"):
        if getattr(a, key) is None:
            setattr(a, key, getattr(PRESETS[a.preset], key))
    a.src = Path(a.src).resolve() if a.src else SRC
    return a


def main() -> None:
    a = parse_args()
    p = PRESETS[a.preset]
    if a.worker is None and not a.here and not in_bench_venv():
        reexec_in_bench_venv(Path(__file__), sys.argv[1:])  # does not return
    if a.worker == "gpufleet":
        gpufleet_run.run(a, p)
    elif a.worker == "trl":
        trl_run.run(a, p)
    else:
        if str(a.src) not in sys.path:
            sys.path.insert(0, str(a.src))
        orchestrate(a, p)


if __name__ == "__main__":
    main()
