"""gpufleet's trainer vs TRL 1.16 `GRPOTrainer` on identical settings, side by side in one run.

    .venv/bin/python bench/vs_trl.py                       # preset speed: 40 steps x seeds 42,43,44, 1 torch thread
    .venv/bin/python bench/vs_trl.py --steps 20 --seeds 0 --lr 3e-3 --threads 2
    .venv/bin/python bench/vs_trl.py --preset learn        # 200 steps at the quickstart's settings; both learn

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
same torch thread count (the numbers are those of `--preset speed`; see PRESETS). TRL gets its fastest fair settings: no gradient checkpointing, no bf16, no
reporting, no checkpoints, no progress bar, data loader workers 0.

Measured: end-to-end step time (time between consecutive step ends, median after a warm-up), CPU
time of the process per step (insensitive to other processes on a shared machine; with --threads > 1
it counts every thread's core-seconds), completions/s, peak RSS, time to the first step, the whole
run's wall time, start-up time (`python -m gpufleet --version` vs `python -c "import trl"` and
friends), and both reward curves. Prints a summary block for the README at the end. No assertions on
time. `--src DIR` benchmarks another gpufleet source tree (e.g. `git archive HEAD src | tar -x -C DIR`).

Presets (`--preset`): `speed` (the default) is the issue's speed measurement: 8 completions per step
(2 prompts x 4 generations), 32 completion tokens, 40 steps; at that batch neither trainer learns
`repeat`. `learn` is examples/quickstart.yaml: 128 completions per step (16 prompts x 8 generations),
8 completion tokens, lr 3e-3, 200 steps (`--steps` changes it); both trainers learn, and the summary
adds a per-seed comparison of the learning curves: the area under the curve (mean reward over all
steps), the first step whose 10-step moving average reaches 0.8, and the difference of the AUCs with
a Welch t statistic and a bootstrap confidence interval (no scipy needed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
BENCH_VENV = ROOT / ".bench-venv"
BENCH_PY = BENCH_VENV / "bin" / "python"

# What .bench-venv holds. Everything else is pinned by constraints.txt (the project's own pins).
REQUIREMENTS = [
    "torch==2.13.0",
    "trl==1.16.0",
    "accelerate==1.15.0",
    "transformers==5.23.0",
    "datasets",
    "pydantic",
    "pyyaml",
    "rich",
    "safetensors",
]
STAMP = BENCH_VENV / ".vs-trl-requirements"

# Shared settings of each preset. `speed`: the issue's measurement; `learn`: examples/quickstart.yaml.
PRESETS: dict[str, dict] = {
    "speed": {"batch": 8, "generations": 4, "completion_tokens": 32, "steps": 40, "lr": 3e-3, "every": 5},
    "learn": {"batch": 128, "generations": 8, "completion_tokens": 8, "steps": 200, "lr": 3e-3, "every": 10},
}
BATCH = 8  # completions per optimizer step (prompts x generations); set from the preset in main()
GENERATIONS = 4
COMPLETION_TOKENS = 32
PROMPT_TOKENS = 8
TEMPERATURE = 1.0
PRESET = "speed"

# The learning-curve comparison (in the summary of --preset learn).
MA_WINDOW = 10  # moving-average window of the "steps to reach" statistic
MA_TARGET = 0.8


def apply_preset(name: str) -> None:
    global BATCH, GENERATIONS, COMPLETION_TOKENS, PRESET
    p = PRESETS[name]
    PRESET, BATCH, GENERATIONS, COMPLETION_TOKENS = name, p["batch"], p["generations"], p["completion_tokens"]


# --------------------------------------------------------------------------- bench venv


def in_bench_venv() -> bool:
    return Path(sys.prefix).resolve() == BENCH_VENV.resolve()


def ensure_bench_venv() -> None:
    """Create .bench-venv (once) and install the pinned requirements; a stamp records what is there."""
    wanted = "\n".join(REQUIREMENTS) + "\n" + (ROOT / "constraints.txt").read_text()
    if BENCH_PY.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return
    print(f"[vs_trl] setting up {BENCH_VENV} (once): {' '.join(REQUIREMENTS[:3])} ...", flush=True)
    if not BENCH_PY.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(BENCH_VENV)], check=True)
    cmd = [
        str(BENCH_PY),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
    ]
    if Path("/opt/wheels").is_dir():  # a local CPU wheel of torch on the project's machines
        cmd += ["--find-links", "/opt/wheels"]
    cmd += ["-c", str(ROOT / "constraints.txt"), *REQUIREMENTS]
    subprocess.run(cmd, check=True)
    STAMP.write_text(wanted)


def reexec_in_bench_venv() -> None:
    ensure_bench_venv()
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    os.execve(str(BENCH_PY), [str(BENCH_PY), str(Path(__file__).resolve()), *sys.argv[1:]], env)


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        ACCELERATE_DISABLE_RICH="1",
    )
    return env


# --------------------------------------------------------------------------- workers (child processes)


def _finish(result: dict, path: Path) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    result["cpu_s_total"] = usage.ru_utime + usage.ru_stime
    path.write_text(json.dumps(result))


def worker_gpufleet(a: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(a.threads)
    from gpufleet.config.load import load_job
    from gpufleet.rl.trainer import train

    out = Path(a.out)
    sets = [
        "model.path=builtin:tiny-qwen2",
        "model.dtype=float32",
        "model.gradient_checkpointing=false",
        "data.path=builtin:repeat",
        "algorithm.name=grpo",
        f"algorithm.num_generations={GENERATIONS}",
        "algorithm.beta=0",
        "algorithm.loss_type=grpo",
        "algorithm.importance_level=token",
        "algorithm.scale_rewards=group",
        "algorithm.epsilon=0.2",
        "algorithm.epsilon_high=0.2",
        "algorithm.num_iterations=1",
        f"rollout.max_prompt_length={PROMPT_TOKENS}",
        f"rollout.max_completion_length={COMPLETION_TOKENS}",
        f"rollout.temperature={TEMPERATURE}",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        f"train.per_device_batch={BATCH}",
        "train.steps_per_generation=1",
        f"train.learning_rate={a.lr}",
        "train.lr_scheduler=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        "train.max_grad_norm=1.0",
        f"train.max_steps={a.steps}",
        f"train.seed={a.seed}",
        "train.precision=fp32",
        "train.log_every=1",
        "train.samples_every=0",
        f"output.dir={out}",
        "output.resume=never",
    ]
    resolved = load_job(None, sets, env={})
    errors = [p for p in resolved.problems if p.severity == "error"]
    if errors:
        raise SystemExit("\n".join(p.render() for p in errors))
    settings = {
        f"{sec}.{f}": str(v)
        for sec in ("algorithm", "rollout", "train")
        for f, v in getattr(resolved.job, sec)
    }
    print("[vs_trl] gpufleet job:", json.dumps(settings), flush=True)
    ends: list[float] = []
    cpu_ends: list[float] = []

    def log(_line: str) -> None:  # called once per step (log_every=1), after the step's metrics
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())

    t_train = time.perf_counter()
    cpu_train = time.process_time()
    train(resolved.job, out, log=log)
    t_done = time.perf_counter()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    own = [r["step_time"] for r in rows]
    _finish(
        {
            "trainer": "gpufleet",
            "seed": a.seed,
            "settings": settings,
            "threads": torch.get_num_threads(),
            "step_time": _intervals(ends, own[0]),
            # (the first entry includes train()'s model build: it is a warm-up step)
            "cpu_step_time": _intervals(cpu_ends, cpu_ends[0] - cpu_train),
            "inner_step_time": own,
            "reward": [r["reward"] for r in rows],
            "completion_length": [r["completions/mean_length"] for r in rows],
            "setup_s": ends[0] - own[0] - t_start,  # imports, job, model, optimizer: until step 1 starts
            "train_s": t_done - t_train,
            "wall_s": t_done - t_start,
        },
        Path(a.result),
    )


def worker_trl(a: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gpufleet.builtin_models import default_root, materialize
    from gpufleet.models import load_tokenizer
    from gpufleet.tasks import builtin_reward, get_task

    # The same folder gpufleet's `builtin:tiny-qwen2` resolves to (same weights, same tokenizer).
    folder = materialize("tiny-qwen2", root=default_root())
    tokenizer = load_tokenizer(str(folder))  # not AutoTokenizer: see gpufleet.models.load_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    # The prompt stream gpufleet reads for builtin:repeat (example i of stream `seed`), in order.
    task = get_task("repeat")
    n_prompts = a.steps * BATCH // GENERATIONS
    dataset = Dataset.from_list([task.make_example(i, a.seed) for i in range(n_prompts)])

    chars = builtin_reward("repeat/chars")
    rewards: list[float] = []
    lengths: list[float] = []

    def repeat_chars(prompts, completions, **columns):  # TRL signature; records the step's mean reward
        out = chars(prompts, completions, **columns)
        rewards.append(sum(out) / len(out))
        lengths.append(sum(len(ids) for ids in columns["completion_ids"]) / len(out))
        return out

    begins: list[float] = []
    ends: list[float] = []
    cpu_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    config = GRPOConfig(
        output_dir=str(Path(a.out)),
        # the shared settings
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        importance_sampling_level="token",
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        mask_truncated_completions=False,  # gpufleet keeps truncated completions in the loss, so does TRL
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=a.steps,
        seed=a.seed,
        data_seed=a.seed,
        shuffle_dataset=False,  # the same prompt order as gpufleet's builtin:repeat stream
        # TRL's fastest fair settings on CPU
        activation_checkpointing=False,  # transformers 5.23's name; TRL's default (True) is under the old one
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[repeat_chars],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    settings = {
        k: str(getattr(config, k))
        for k in (
            "activation_checkpointing bf16 fp16 use_cpu loss_type scale_rewards importance_sampling_level "
            "epsilon epsilon_high beta num_generations per_device_train_batch_size generation_batch_size "
            "steps_per_generation learning_rate mask_truncated_completions "
            "max_completion_length temperature top_p top_k min_p lr_scheduler_type optim max_grad_norm "
            "num_iterations report_to logging_steps save_strategy"
        ).split()
    }
    settings["model.is_activation_checkpointing"] = str(
        getattr(trainer.model, "is_activation_checkpointing", "n/a")
    )
    print("[vs_trl] TRL effective settings:", json.dumps(settings), flush=True)
    t_train = time.perf_counter()
    cpu_train = time.process_time()
    trainer.train()
    t_done = time.perf_counter()
    _finish(
        {
            "trainer": "trl",
            "seed": a.seed,
            "settings": settings,
            "threads": torch.get_num_threads(),
            "step_time": _intervals(ends, ends[0] - begins[0]),
            "cpu_step_time": _intervals(cpu_ends, cpu_ends[0] - cpu_train),
            "inner_step_time": [e - b for b, e in zip(begins, ends, strict=True)],
            "reward": rewards,
            "completion_length": lengths,
            "setup_s": begins[0] - t_start,  # imports, model, dataset, trainer: until step 1 starts
            "train_s": t_done - t_train,
            "wall_s": t_done - t_start,
        },
        Path(a.result),
    )


def _intervals(stamps: list[float], first: float) -> list[float]:
    """Per-step times from step-end time stamps: the first step's own time, then end-to-end gaps."""
    return [first] + [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


# --------------------------------------------------------------------------- orchestration


def run_worker(kind: str, seed: int, a: argparse.Namespace, work: Path) -> dict:
    out = work / f"{kind}-seed{seed}"
    result = work / f"{kind}-seed{seed}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--seed",
        str(seed),
        "--preset",
        a.preset,
        "--steps",
        str(a.steps),
        "--lr",
        repr(a.lr),
        "--threads",
        str(a.threads),
        "--out",
        str(out),
        "--result",
        str(result),
    ]
    log = work / f"{kind}-seed{seed}.log"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(a.threads), cwd=ROOT
        ).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"[vs_trl] {kind} seed {seed} failed (exit {rc}); log {log}:\n{tail}")
    r = json.loads(result.read_text())
    r["process_s"] = time.perf_counter() - t0
    r["load_before"] = load
    r["load_after"] = os.getloadavg()[0]
    return r


STARTUP = {
    "python -c pass": ["-c", "pass"],
    "python -m gpufleet --version": ["-m", "gpufleet", "--version"],
    "python -c 'import gpufleet'": ["-c", "import gpufleet"],
    "python -c 'import gpufleet.rl.trainer'": ["-c", "import gpufleet.rl.trainer"],
    "python -c 'import trl'": ["-c", "import trl"],
    "python -c 'from trl import GRPOTrainer'": ["-c", "from trl import GRPOTrainer"],
}


def measure_startup(runs: int, threads: int) -> dict[str, list[float]]:
    """Wall time of each command as a whole process; the commands are interleaved run by run."""
    times: dict[str, list[float]] = {k: [] for k in STARTUP}
    env = child_env(threads)
    for args in STARTUP.values():  # one untimed run each: warm the page cache and .pyc files
        subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, check=True)
    for _ in range(runs):
        for name, args in STARTUP.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, check=True)
            times[name].append(time.perf_counter() - t0)
    return times


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def sd(xs: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for a single value."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def auc(rewards: list[float]) -> float:
    """Area under the reward curve per step: the mean reward over all steps of one run."""
    return mean(rewards)


def steps_to_reach(rewards: list[float], window: int = MA_WINDOW, target: float = MA_TARGET) -> int | None:
    """First step (1-based) whose `window`-step moving average (that step and the window - 1 before it)
    reaches `target`; None if no step does."""
    for end in range(window, len(rewards) + 1):
        if mean(rewards[end - window : end]) >= target:
            return end
    return None


def welch(x: list[float], y: list[float]) -> tuple[float, float]:
    """Welch's t statistic of mean(x) - mean(y) and its Welch-Satterthwaite degrees of freedom."""
    vx, vy = sd(x) ** 2 / len(x), sd(y) ** 2 / len(y)
    diff = mean(x) - mean(y)
    if vx + vy == 0:
        return (0.0 if diff == 0 else math.copysign(math.inf, diff)), float("nan")
    df_den = (vx**2 / (len(x) - 1) if len(x) > 1 else 0) + (vy**2 / (len(y) - 1) if len(y) > 1 else 0)
    return diff / math.sqrt(vx + vy), ((vx + vy) ** 2 / df_den if df_den else float("nan"))


def bootstrap_ci(
    x: list[float], y: list[float], n: int = 20000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(x) - mean(y): seeds resampled with replacement within each trainer.
    (With 3 seeds per trainer it is narrow-biased: a resample sees at most 3 distinct values.)"""
    rng = random.Random(seed)
    diffs = sorted(mean(rng.choices(x, k=len(x))) - mean(rng.choices(y, k=len(y))) for _ in range(n))
    lo = diffs[int((1 - level) / 2 * n)]
    hi = diffs[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


def learning_stats(results: dict[str, list[dict]]) -> dict:
    """Per-seed AUC and steps-to-0.8 of each trainer, and the AUC difference gpufleet - TRL."""
    out: dict = {}
    for kind in ("gpufleet", "trl"):
        runs = results[kind]
        out[kind] = {
            "seeds": [r["seed"] for r in runs],
            "auc": [auc(r["reward"]) for r in runs],
            "reach": [steps_to_reach(r["reward"]) for r in runs],
        }
    g, t = out["gpufleet"]["auc"], out["trl"]["auc"]
    out["diff"] = mean(g) - mean(t)
    out["t"], out["df"] = welch(g, t) if min(len(g), len(t)) > 1 else (float("nan"), float("nan"))
    out["ci"] = bootstrap_ci(g, t)
    out["t_small"] = abs(out["t"]) < 2
    out["ci_has_0"] = out["ci"][0] <= 0 <= out["ci"][1]
    out["equal"] = out["t_small"] and out["ci_has_0"]
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def versions() -> str:
    import importlib.metadata as md

    return ", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "trl", "accelerate"))


def orchestrate(a: argparse.Namespace) -> None:
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpufleet-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] {versions()}; {cpu_model()}, {os.cpu_count()} cores; torch threads {a.threads} (both)")
    print(
        f"[vs_trl] preset {PRESET}: {BATCH} completions/step ({BATCH // GENERATIONS} prompts x {GENERATIONS} generations), "
        f"{COMPLETION_TOKENS} completion tokens, lr {a.lr:g}, {a.steps} steps, seeds {','.join(map(str, a.seeds))}"
    )
    print(
        f"[vs_trl] gpufleet from {SRC}; work dir {work}; load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )

    # Materialize the model once, up front, so neither trainer pays for building it.
    subprocess.run(
        [sys.executable, "-c", "from gpufleet.builtin_models import materialize; materialize('tiny-qwen2')"],
        env=child_env(a.threads),
        cwd=ROOT,
        check=True,
    )

    startup = measure_startup(a.startup_runs, a.threads) if a.startup_runs > 0 else {}
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
            w = r["step_time"][a.warmup :]
            print(
                f"  {kind:8s} seed {seed}: median step {med(w) * 1000:6.0f} ms (cpu {med(r['cpu_step_time'][a.warmup :]) * 1000:5.0f} ms)"
                f"  AUC {auc(r['reward']):.3f}  last-10 reward {mean(r['reward'][-10:]):.3f}"
                f"  reach {MA_TARGET:g} @ {steps_to_reach(r['reward']) or '-'}  peak RSS {r['peak_rss_mib']:.0f} MiB"
                f"  run {r['process_s']:.1f} s  (load {r['load_before']:.2f} -> {r['load_after']:.2f})",
                flush=True,
            )
    (work / "results.json").write_text(json.dumps({"startup": startup, "runs": results}, indent=1))
    report(a, results, startup, loads, work)


def report(a, results, startup, loads, work: Path) -> None:
    k, W = a.every, a.warmup

    def curve(kind: str) -> list[float]:  # mean over seeds, per step
        runs = results[kind]
        return [mean([r["reward"][s] for r in runs]) for s in range(min(len(r["reward"]) for r in runs))]

    g_curve, t_curve = curve("gpufleet"), curve("trl")
    print(
        f"\nreward (mean over seeds {','.join(map(str, a.seeds))}); 'mean{k}' = mean of the {k} steps ending there"
    )
    print(f"  {'step':>5}  {'gpufleet':>9} {'mean' + str(k):>7}   {'TRL':>9} {'mean' + str(k):>7}")
    curve_rows = []
    for s in range(k, len(g_curve) + 1, k):
        print(
            f"  {s:>5}  {g_curve[s - 1]:>9.3f} {mean(g_curve[s - k : s]):>7.3f}"
            f"   {t_curve[s - 1]:>9.3f} {mean(t_curve[s - k : s]):>7.3f}"
        )
        curve_rows.append(f"| {s} | {mean(g_curve[s - k : s]):.3f} | {mean(t_curve[s - k : s]):.3f} |")
    (work / "curves.json").write_text(json.dumps({"gpufleet": g_curve, "trl": t_curve}))
    ls = learning_stats(results)

    def pooled(kind: str, key: str) -> list[float]:
        return [x for r in results[kind] for x in r[key][W:]]

    def per_seed_median(kind: str, key: str) -> list[float]:
        return [med(r[key][W:]) for r in results[kind]]

    g_step, t_step = med(pooled("gpufleet", "step_time")), med(pooled("trl", "step_time"))
    g_cpu, t_cpu = med(pooled("gpufleet", "cpu_step_time")), med(pooled("trl", "cpu_step_time"))
    g_rss = max(r["peak_rss_mib"] for r in results["gpufleet"])
    t_rss = max(r["peak_rss_mib"] for r in results["trl"])
    g_wall = med([r["process_s"] for r in results["gpufleet"]])
    t_wall = med([r["process_s"] for r in results["trl"]])
    g_setup = med([r["setup_s"] for r in results["gpufleet"]])
    t_setup = med([r["setup_s"] for r in results["trl"]])
    g_last = mean([mean(r["reward"][-10:]) for r in results["gpufleet"]])
    t_last = mean([mean(r["reward"][-10:]) for r in results["trl"]])
    g_first = mean([mean(r["reward"][:10]) for r in results["gpufleet"]])
    t_first = mean([mean(r["reward"][:10]) for r in results["trl"]])

    def seed_ratios(key: str) -> str:
        pairs = zip(per_seed_median("gpufleet", key), per_seed_median("trl", key), strict=True)
        return ", ".join(f"{g / t:.2f}" for g, t in pairs)

    contention = max(g_step / g_cpu, t_step / t_cpu)  # ~1.0 when each process had a core to itself

    def su(name: str) -> str:
        return f"{med(startup[name]) * 1000:.0f} ms" if name in startup else "-"

    def su_ratio(a_: str, b_: str) -> str:
        return f"{med(startup[a_]) / med(startup[b_]):.2f}" if a_ in startup and b_ in startup else "-"

    loadtxt = f"1-min load average {min(loads):.2f}-{max(loads):.2f} during the run, this benchmark's own ~1 included"
    lines = [
        "### gpufleet vs TRL GRPOTrainer (`bench/vs_trl.py`)",
        "",
        f"{cpu_model()}, {os.cpu_count()} cores ({loadtxt}); torch.set_num_threads({a.threads}) in both; {versions()}.",
        f"Preset `{PRESET}`. Both: builtin:tiny-qwen2 fp32, builtin:repeat, {BATCH} completions/step ({BATCH // GENERATIONS} prompts x "
        f"{GENERATIONS} generations), {COMPLETION_TOKENS} completion tokens, temperature {TEMPERATURE}, beta 0, loss_type grpo, "
        f"lr {a.lr:g} constant, {a.steps} steps, seeds {','.join(map(str, a.seeds))}; median over steps after {W} warm-up steps, all seeds pooled.",
        "",
        "| | gpufleet | TRL 1.16 | gpufleet / TRL |",
        "|---|---:|---:|---:|",
        f"| step time (wall, median) | {g_step * 1000:.0f} ms | {t_step * 1000:.0f} ms | **{g_step / t_step:.2f}** (per seed: {seed_ratios('step_time')}) |",
        f"| step time (CPU time of the process, median) | {g_cpu * 1000:.0f} ms | {t_cpu * 1000:.0f} ms | **{g_cpu / t_cpu:.2f}** (per seed: {seed_ratios('cpu_step_time')}) |",
        f"| wall / CPU per step (1.00: a core to itself) | {g_step / g_cpu:.2f} | {t_step / t_cpu:.2f} | |",
        f"| completions/s | {BATCH / g_step:.1f} | {BATCH / t_step:.1f} | {t_step / g_step:.2f}x |",
        f"| peak RSS (ru_maxrss, max over seeds) | {g_rss:.0f} MiB | {t_rss:.0f} MiB | {g_rss / t_rss:.2f} |",
        f"| time to the first step in the process (imports, model, trainer) | {g_setup:.1f} s | {t_setup:.1f} s | {g_setup / t_setup:.2f} |",
        f"| whole training process, {a.steps} steps | {g_wall:.1f} s | {t_wall:.1f} s | {g_wall / t_wall:.2f} |",
        f"| start-up: `gpufleet --version` vs `import trl` | {su('python -m gpufleet --version')} | {su(STARTUP_TRL)} | {su_ratio('python -m gpufleet --version', STARTUP_TRL)} |",
        f"| start-up: `import gpufleet.rl.trainer` vs `from trl import GRPOTrainer` | {su('python -c ' + repr('import gpufleet.rl.trainer'))} | {su(STARTUP_TRL_FULL)} | {su_ratio('python -c ' + repr('import gpufleet.rl.trainer'), STARTUP_TRL_FULL)} |",
        f"| reward, mean of first 10 steps | {g_first:.3f} | {t_first:.3f} | |",
        f"| reward, mean of last 10 steps | {g_last:.3f} | {t_last:.3f} | |",
        "",
        *(learning_lines(a, ls, curve_rows, k) if PRESET == "learn" else []),
        f"(`python -c pass`: {su('python -c pass')}. Goal for the step-time ratio: <= 0.5. Raw data: {work / 'results.json'}.)",
        *(
            [
                f"(wall / CPU reached {contention:.2f}: other processes took CPU during the run, so the wall"
                " times are inflated and noisy; the CPU-time row is the one to compare.)"
            ]
            if contention > 1.15
            else []
        ),
    ]
    print("\n" + "=" * 30 + " summary (paste into README) " + "=" * 30)
    print("\n".join(lines))
    print("=" * 89)


def learning_lines(a, ls: dict, curve_rows: list[str], k: int) -> list[str]:
    """The learning-curve part of the summary: curves, per-seed AUC and steps to 0.8, the AUC test."""

    def fmt(xs) -> str:
        return ", ".join("-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x)) for x in xs)

    def reach(kind: str) -> str:
        got = [x for x in ls[kind]["reach"] if x is not None]
        if not got:
            return f"not reached in {a.steps} steps"
        txt = f"{mean(got):.0f} ± {sd(got):.0f}"
        return (
            txt
            if len(got) == len(ls[kind]["reach"])
            else f"{txt} ({len(got)} of {len(ls[kind]['reach'])} seeds reached it)"
        )

    g, t = ls["gpufleet"], ls["trl"]
    lo, hi = ls["ci"]
    if min(len(g["auc"]), len(t["auc"])) < 2:
        verdict = "no test: it needs at least 2 seeds per trainer"
    elif ls["equal"]:
        verdict = "**equal within seed noise** (|t| < 2 and the CI contains 0)"
    elif not ls["t_small"] and not ls["ci_has_0"]:
        verdict = "**different beyond seed noise** (|t| >= 2 and the CI excludes 0)"
    else:  # the two criteria disagree: not shown equal, not shown different
        verdict = (
            "**not shown equal within seed noise** ("
            + ("|t| < 2" if ls["t_small"] else "|t| >= 2")
            + (", but the CI excludes 0" if not ls["ci_has_0"] else ", but the CI contains 0")
            + f"; more seeds needed, e.g. --seeds {','.join(str(42 + i) for i in range(10))})"
        )
    lines = [
        f"Reward curves, mean over seeds {','.join(map(str, a.seeds))}; each row is the mean of the {k} steps ending there:",
        "",
        "| step | gpufleet | TRL 1.16 |",
        "|---:|---:|---:|",
        *curve_rows,
        "",
        f"Learning, per seed ({', '.join(map(str, g['seeds']))} for gpufleet; {', '.join(map(str, t['seeds']))} for TRL). "
        f"AUC = mean reward over all {a.steps} steps; reach = first step whose {MA_WINDOW}-step moving average is >= {MA_TARGET:g}:",
        "",
        "| | gpufleet | TRL 1.16 |",
        "|---|---:|---:|",
        f"| AUC per seed | {fmt(g['auc'])} | {fmt(t['auc'])} |",
        f"| AUC, mean ± std over seeds | {mean(g['auc']):.3f} ± {sd(g['auc']):.3f} | {mean(t['auc']):.3f} ± {sd(t['auc']):.3f} |",
        f"| reach {MA_TARGET:g}, step per seed | {fmt(g['reach'])} | {fmt(t['reach'])} |",
        f"| reach {MA_TARGET:g}, mean ± std over seeds | {reach('gpufleet')} | {reach('trl')} |",
        "",
        f"AUC difference gpufleet - TRL: {ls['diff']:+.3f}; Welch t = {ls['t']:+.2f} (df {ls['df']:.1f}); "
        f"bootstrap 95% CI of the difference [{lo:+.3f}, {hi:+.3f}] -> {verdict}.",
        "",
    ]
    return lines


STARTUP_TRL = "python -c 'import trl'"
STARTUP_TRL_FULL = "python -c 'from trl import GRPOTrainer'"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="speed",
        help="shared settings: speed (default; 8 completions/step, 32 tokens, 40 steps: the issue's speed "
        "measurement) or learn (examples/quickstart.yaml: 16 prompts x 8 generations, 8 tokens, 200 steps)",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default: the preset's, 40 / 200)"
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
    apply_preset(a.preset)
    for key in ("steps", "lr", "every"):
        if getattr(a, key) is None:
            setattr(a, key, PRESETS[a.preset][key])
    global SRC
    if a.src:
        SRC = Path(a.src).resolve()
    if a.worker is None and not in_bench_venv():
        reexec_in_bench_venv()  # does not return
    if a.worker == "gpufleet":
        worker_gpufleet(a)
    elif a.worker == "trl":
        worker_trl(a)
    else:
        if str(SRC) not in sys.path:
            sys.path.insert(0, str(SRC))
        orchestrate(a)


if __name__ == "__main__":
    main()
