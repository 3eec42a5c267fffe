"""What both sides of `vs_trl.py` share: the presets' settings, the clock of one training process, the
result file each worker writes, and the start-up timings of whole processes.

Both workers (`gpufleet_run.py`, `trl_run.py`) measure the same way: a `StepClock` made first thing in the
process, `clock.step_end()` at the end of every optimizer step, training run under `clock.train(...)`,
then `write_result(...)`, which adds the process's peak RSS and CPU time.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROMPT_TOKENS = 8
PROMPT_WIDTH = 2
"""Tokens of every `builtin:repeat` prompt ("h:"; one per character): the padded prompt width of a batch."""
TEMPERATURE = 1.0


@dataclass(frozen=True)
class Preset:
    """Settings shared by both trainers. `speed`: the issue's measurement at tiny size; `small`: the same at
    3.2M parameters with a reference model; `learn`: the quickstart's task at its
    first settings (budget 8, `repeat/chars`; examples/quickstart.yaml now also teaches <eos>); `gpu`:
    the small preset's batch on a 0.5B model (Qwen2.5-0.5B's shapes), for `--device cuda`."""

    name: str
    batch: int  # completions per optimizer step (prompts x generations)
    generations: int  # completions per prompt
    completion_tokens: int
    steps: int  # default of --steps
    lr: float  # default of --lr
    every: int  # default of --every
    model: str = "tiny-qwen2"  # a gpufleet built-in model, or a key of BENCH_MODELS
    beta: float = 0.0  # KL coefficient (> 0: a reference model's forward in every step)


PRESETS: dict[str, Preset] = {
    "speed": Preset("speed", batch=8, generations=4, completion_tokens=32, steps=40, lr=3e-3, every=5),
    "small": Preset(
        "small",
        batch=16,
        generations=8,
        completion_tokens=64,
        steps=20,
        lr=1e-3,
        every=5,
        model="qwen2-256x4",
        beta=0.04,
    ),
    "learn": Preset("learn", batch=128, generations=8, completion_tokens=8, steps=200, lr=3e-3, every=10),
    "gpu": Preset(
        "gpu",
        batch=16,
        generations=8,
        completion_tokens=64,
        steps=10,
        lr=1e-6,
        every=5,
        model="qwen2.5-0.5b",
        beta=0.04,
    ),
}

PRESETS["gpu-long"] = Preset(  # issue 37's whole step: 64 completions x 512 tokens of a 0.5B model, in bf16
    "gpu-long",
    batch=64,
    generations=8,
    completion_tokens=512,
    steps=4,
    lr=1e-6,
    every=2,
    model="qwen2.5-0.5b",
    beta=0.04,
)

BENCH_MODELS: dict[str, dict[str, int]] = {
    "qwen2-256x4": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
    },
    "qwen2.5-0.5b": {  # Qwen2.5-0.5B's config.json shapes (its 151,936-token vocabulary included)
        "vocab_size": 151936,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 4864,
    },
    "qwen2.5-1.5b": {  # Qwen2.5-1.5B's config.json shapes (tied embeddings, as the real model)
        "vocab_size": 151936,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 8960,
    },
}
"""Benchmark models: builtin:tiny-qwen2's config.json (character vocabulary, tied embeddings) with these
sizes. `qwen2-256x4`: 3.2M parameters. `qwen2.5-0.5b`: Qwen2.5-0.5B's shapes and vocabulary size (494M
parameters; the character tokenizer covers the first ids only, so a sampled id past it decodes as
nothing), for the `gpu` preset."""


def model_config(p: Preset) -> dict:
    """The config.json dict of preset `p`'s model."""
    from gpufleet.models.builtin import builtin_config

    if p.model in BENCH_MODELS:
        return builtin_config("tiny-qwen2") | BENCH_MODELS[p.model]
    return builtin_config(p.model)


def model_folder(p: Preset) -> Path:
    """The Hugging Face folder both trainers load (made once, in gpufleet's cache, with seed-0 weights)."""
    from gpufleet.models.builtin import default_root, materialize, materialize_config

    if p.model in BENCH_MODELS:
        return materialize_config(model_config(p), default_root() / "models" / f"bench-{p.model}")
    return materialize(p.model, root=default_root())


def intervals(stamps: list[float], first: float) -> list[float]:
    """Per-step times from step-end time stamps: the first step's own time, then end-to-end gaps."""
    return [first] + [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


class StepClock:
    """Wall and CPU time stamps of one training process, from its start (when the clock is made) on."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.train_start = self.cpu_train_start = self.train_end = float("nan")

    def step_begin(self) -> None:
        self.begins.append(time.perf_counter())

    def step_end(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def train(self, run: Callable[[], object]) -> None:
        """Call `run()` (the whole training), recording when it starts and ends."""
        self.train_start, self.cpu_train_start = time.perf_counter(), time.process_time()
        run()
        self.train_end = time.perf_counter()

    def timings(self, first_step_s: float) -> dict[str, float | list[float]]:
        """Step times (wall: `first_step_s`, the first step's own time, then the gaps between step ends;
        CPU: the first entry counts from the start of training, so it includes what the trainer builds
        there: a warm-up step), time to the start of step 1, training time and the whole run's time."""
        return {
            "step_time": intervals(self.ends, first_step_s),
            "cpu_step_time": intervals(self.cpu_ends, self.cpu_ends[0] - self.cpu_train_start),
            "setup_s": self.ends[0] - first_step_s - self.start,  # imports, model, trainer: until step 1
            "train_s": self.train_end - self.train_start,
            "wall_s": self.train_end - self.start,
        }


def add_peak(path: Path, p: Preset, threads: int, device: str, precision: str) -> None:
    """Add to a run's result file the matmul peak over the step's shapes (`gemm_peak.measure`, 2 trials
    each; CPU-time FLOP/s, or the GPU's), measured in the worker right after its run: the machine as that
    run found it (the clock moves between runs of one afternoon; `phases.py` reports the step against
    both peaks), and the seconds it took (`vs_trl.py` leaves them out of the process's time)."""
    from gemm_peak import measure

    t0 = time.perf_counter()
    dtype = "bfloat16" if precision == "bf16" else "float32"
    cfg = model_config(p)
    peak = measure(cfg, p.batch, PROMPT_TOKENS, p.completion_tokens, threads, 2, device, dtype)["peak_cpu"]
    result = json.loads(path.read_text())
    result |= {"peak": peak, "peak_s": time.perf_counter() - t0}
    path.write_text(json.dumps(result))


def write_result(path: Path, clock: StepClock, first_step_s: float, **fields: object) -> None:
    """Write one run's result: `fields` (trainer, seed, settings, reward, ...), the clock's timings, and this
    process's peak RSS (`ru_maxrss`) and CPU time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        **fields,
        **clock.timings(first_step_s),
        "peak_rss_mib": usage.ru_maxrss / 1024,  # Linux: KiB
        "cpu_s_total": usage.ru_utime + usage.ru_stime,
    }
    path.write_text(json.dumps(result))


STARTUP_GPUFLEET = "python -m gpufleet --version"
STARTUP_GPUFLEET_FULL = "python -c 'import gpufleet.rl.trainer'"
STARTUP_TRL = "python -c 'import trl'"
STARTUP_TRL_FULL = "python -c 'from trl import GRPOTrainer'"
STARTUP_PYTHON = "python -c pass"
STARTUP = {
    STARTUP_PYTHON: ["-c", "pass"],
    STARTUP_GPUFLEET: ["-m", "gpufleet", "--version"],
    "python -c 'import gpufleet'": ["-c", "import gpufleet"],
    STARTUP_GPUFLEET_FULL: ["-c", "import gpufleet.rl.trainer"],
    STARTUP_TRL: ["-c", "import trl"],
    STARTUP_TRL_FULL: ["-c", "from trl import GRPOTrainer"],
}


def measure_startup(runs: int, env: dict[str, str], cwd: Path) -> dict[str, list[float]]:
    """Wall time of each command as a whole process; the commands are interleaved run by run."""
    times: dict[str, list[float]] = {k: [] for k in STARTUP}
    for args in STARTUP.values():  # one untimed run each: warm the page cache and .pyc files
        subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, check=True)
    for _ in range(runs):
        for name, args in STARTUP.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, check=True)
            times[name].append(time.perf_counter() - t0)
    return times
