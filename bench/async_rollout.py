"""A dedicated rollout rank, lock-step and one step ahead, against the colocated run: measured side by side.

    .venv/bin/python bench/async_rollout.py          # timing: 3 seeds x 60 steps x 4 layouts; learning: 3 x 200 x 2
    .venv/bin/python bench/async_rollout.py --steps 3 --warmup 1 --seeds 0,1 --learn-steps 3 --batch 8 --tokens 8
    .venv/bin/python bench/async_rollout.py --no-learning --src old=/tmp/old/src --src new=/tmp/new/src  # codes

Runs the installed `gpufleet train` (this checkout's .venv) from a work folder, one job in several
layouts, seed by seed (the order rotates): (a) `colocated`: 1 process samples and trains in lock-step;
(b) `lockstep`: 1 policy + 1 rollout rank (`placement.rollout: [1]`), `rollout.async_steps: 0`; (c)
`async`: the same, `rollout.async_steps: 1`; (d) `async_no_is`: (c) without
`algorithm.importance_sampling_correction` (its two log-prob passes). 1 torch thread per process
(OMP_NUM_THREADS=1, which the CPU launcher keeps). The timing job has generation ~= training in (a):
builtin tiny-qwen2, task repeat, `repeat/letters`, 16 completions per step (2 prompts x 8), 128 tokens
(min 127: a constant length, so the step does not drift as the model learns), lr 3e-3. It does not learn
in 200 steps (8 of 128 tokens are scored), so the learning curves come from `vs_trl.py`'s `learn` preset
(128 completions per step, 8 tokens, `repeat/chars`, lr 3e-3, 200 steps): (a) vs (c), same seeds.

Printed per run: medians after --warmup steps of step_time, timing/generate, "train" (= step_time -
timing/generate), timing/score, timing/weight_sync, timing/rollout_wait; the CPU-seconds per step of each
process (from /proc: a process waiting in a gloo collective uses none) and how busy the machine was
(other users included). Then (c)/(a) measured and projected for an idle machine (the critical path's
CPU per step, the busiest process's or in lock-step the sum, over the colocated one's), the hidden fraction of the shorter phase (T_gen + T_train -
T_async) / min(T_gen, T_train) from the colocated medians, the AUC per seed with Welch's t and a
bootstrap CI (bench/stats.py), and timing/weight_sync per step with a 7B's push over NVLink and PCIe
(computed from bytes / bandwidth, not measured). No assertions on time. With --src CODE=DIR (a `git archive`
of some commit's src, on PYTHONPATH) each layout runs with each code, adjacent (`async@new`), ratios to the
first code's colocated run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from measure import PRESETS
from stats import auc, bootstrap_ci, mean, med, sd, welch

ROOT = Path(__file__).resolve().parents[1]
GPUFLEET = ROOT / ".venv" / "bin" / "gpufleet"
ROLLOUT_RANK = ("placement.rollout=1",)
LAYOUTS = {"colocated": (), "lockstep": (*ROLLOUT_RANK, "rollout.async_steps=0")}
LAYOUTS["async"] = (*ROLLOUT_RANK, "rollout.async_steps=1")
LAYOUTS["async_no_is"] = (*LAYOUTS["async"], "algorithm.importance_sampling_correction=false")
TICK = os.sysconf("SC_CLK_TCK")
SEVEN_B = 7.6e9  # Qwen2.5-7B's parameters
LINKS = {"NVLink (broadcast, effective)": (150e9, 200e9), "PCIe 4.0 x16 (effective)": (20e9, 25e9)}


@dataclass(frozen=True)
class BenchJob:
    name: str
    model: str
    batch: int  # completions per step
    generations: int
    tokens: int  # max_completion_length
    min_tokens: int  # min_completion_length
    reward: str
    lr: float
    steps: int
    warmup: int  # steps left out of the medians


def jobs(a: argparse.Namespace) -> tuple[BenchJob, BenchJob]:
    """The timing job (generation ~= training when colocated) and the learning job (vs_trl's `learn`)."""
    learn = PRESETS["learn"]
    t = (a.model, a.batch, a.generations, a.tokens, a.tokens - 1, "repeat/letters", a.lr, a.steps, a.warmup)
    n, g, k = learn.batch, learn.generations, learn.completion_tokens
    warmup = min(a.warmup, a.learn_steps - 1)
    l_ = ("tiny-qwen2", n, g, k, 0, "repeat/chars", learn.lr, a.learn_steps, warmup)
    return BenchJob("timing", *t), BenchJob("learn", *l_)


def job_yaml(j: BenchJob) -> str:
    """Job `j`'s file; the layouts differ only by --set (placement.rollout, rollout.async_steps)."""
    return f"""model:
  path: builtin:{j.model}
data:
  path: builtin:repeat
reward:
  functions: [{j.reward}]
algorithm:
  name: grpo
  num_generations: {j.generations}
  loss_type: grpo
rollout:
  max_prompt_length: 8
  max_completion_length: {j.tokens}
  min_completion_length: {j.min_tokens}
  temperature: 1.0
train:
  per_device_batch: {j.batch}
  learning_rate: {j.lr}
  log_every: 50
  samples_every: 0
output:
  save_every: 0
  resume: never
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _role(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
    return f"rank{rank}" if rank is not None else "main"


def _tree(root: int) -> list[int]:
    """`root` and every process below it."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out


def _machine_busy() -> float:
    """CPU-seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK


class CpuWatch(threading.Thread):
    """Samples, every 0.2 s, the CPU-seconds of each process of one run (by rank) and of the whole
    machine; `window()` gives them over the steps after the warm-up (from when metrics.jsonl has
    `warmup` lines to the last sample before it has all of them)."""

    def __init__(self, root: int, metrics: Path, warmup: int, steps: int) -> None:
        super().__init__(daemon=True)
        self.root, self.metrics, self.warmup, self.steps = root, metrics, warmup, steps
        self.first: tuple | None = None
        self.last: tuple | None = None
        self.done = threading.Event()

    def _lines(self) -> int:
        try:
            return self.metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _sample(self, steps: int) -> tuple[float, float, dict[str, float], int]:
        roles: dict[str, float] = {}
        for pid in _tree(self.root):
            try:
                role = _role(pid)
                roles[role] = roles.get(role, 0.0) + _cpu_seconds(pid)
            except OSError:
                continue
        return time.perf_counter(), _machine_busy(), roles, steps

    def run(self) -> None:
        while not self.done.wait(0.2):
            n = self._lines()
            if n >= self.steps:
                return
            if n >= self.warmup:
                sample = self._sample(n)
                self.first = self.first or sample
                self.last = sample

    def window(self) -> dict:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        dt = self.last[0] - self.first[0]
        per = {k: (v - self.first[2].get(k, 0.0)) / dt for k, v in self.last[2].items()}
        machine = (self.last[1] - self.first[1]) / dt
        steps = max(self.last[3] - self.first[3], 1)
        per_step = {k: v * dt / steps for k, v in per.items()}  # CPU-seconds per step
        others = machine - sum(per.values())
        return {"seconds": dt, "cores": per, "per_step": per_step, "machine": machine, "others": others}


def train(j: BenchJob, work: Path, layout: str, seed: int, src: str | None = None) -> dict:
    """One `gpufleet train` of job `j` in `layout` (`LAYOUT@CODE`: with --src CODE's package); its metrics,
    the CPU it used and the load around it."""
    name = f"{j.name}-{layout.replace('@', '-')}-seed{seed}"
    out = work / "runs" / name
    sets = [f"output.dir={out}", f"train.seed={seed}", f"train.max_steps={j.steps}"]
    sets += LAYOUTS[layout.split("@")[0]]
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env.pop("PYTHONPATH", None)
    if src:  # this copy of the package instead of the checkout's (PYTHONPATH comes before the editable path)
        env["PYTHONPATH"] = src
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [str(GPUFLEET), "train", f"{j.name}.yaml", *[x for s in sets for x in ("--set", s)]]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with (work / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        watch = CpuWatch(proc.pid, out / "metrics.jsonl", j.warmup, j.steps)
        watch.start()
        rc = proc.wait()
        watch.done.set()
    if rc != 0:
        tail = "\n".join((work / f"{name}.log").read_text().splitlines()[-20:])
        raise SystemExit(f"[async_rollout] {name} failed (exit {rc}):\n{tail}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    loads = (load, os.getloadavg()[0])
    return {"rows": rows, "cpu": watch.window(), "load": loads, "wall": time.perf_counter() - t0, "out": out}


def medians(run: dict, warmup: int) -> dict[str, float]:
    """Per-step medians after the warm-up: the step, generate, the rest, and the rollout rank's timings."""
    rows = run["rows"][warmup:] or run["rows"]
    m = {k: med([r.get(f"timing/{k}", 0.0) for r in rows]) for k in ("generate", "score", "backward")}
    m |= {k: med([r.get(f"timing/{k}", 0.0) for r in rows]) for k in ("weight_sync", "rollout_wait")}
    m["step"] = med([r["step_time"] for r in rows])
    m["train"] = med([r["step_time"] - r.get("timing/generate", 0.0) for r in rows])
    rest = [
        r["timing/generate"] - r.get("timing/weight_sync", 0) - r.get("timing/rollout_wait", 0) for r in rows
    ]
    m["unattributed"] = med(rest)
    return m


def print_run(layout: str, seed: int, run: dict, m: dict) -> None:
    cpu = run["cpu"]
    cores = ", ".join(
        f"{k} {v:.2f} ({cpu['per_step'][k] * 1e3:.0f} ms/step)"
        for k, v in sorted(cpu.get("cores", {}).items())
        if v > 0.005
    )
    load = f"load {run['load'][0]:.1f} -> {run['load'][1]:.1f}"
    if cpu:
        busy = f"machine busy {cpu['machine']:.2f} of {os.cpu_count()} (others {cpu['others']:.2f})"
        load = f"\n      cores used: {cores}; {busy}; {load}"
    print(
        f"  {layout:9s} seed {seed}: step {m['step'] * 1e3:6.1f} ms  generate {m['generate'] * 1e3:6.1f}"
        f"  train {m['train'] * 1e3:6.1f} (score {m['score'] * 1e3:5.1f})  weight_sync {m['weight_sync'] * 1e3:5.2f}"
        f"  rollout_wait {m['rollout_wait'] * 1e3:5.1f}  AUC {auc([r['reward'] for r in run['rows']]):.3f}  {load}",
        flush=True,
    )


def safetensors_params(folder: Path) -> int:
    """Parameters in a folder's *.safetensors files, from their headers (no tensor is read)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def cpu_per_step(runs: list[dict], overlap: bool = True) -> float:
    """Median over runs of the CPU-seconds per step on the critical path with a core per process: the
    busiest process's when the processes overlap (colocated, async), the processes' sum in lock-step."""
    return med([(max if overlap else sum)(r["cpu"]["per_step"].values()) for r in runs if r["cpu"]])


def timing_summary(j: BenchJob, runs: dict[str, list[dict]], med_of: dict[str, list[dict]]) -> None:
    """The layouts' medians over seeds, the ratios to the colocated run and the hidden fraction."""
    print(f"\n[async_rollout] medians over seeds of the per-run medians (steps {j.warmup + 1}..{j.steps}):")
    agg = {lay: {k: med([m[k] for m in ms]) for k in ms[0]} for lay, ms in med_of.items()}
    for lay, m in agg.items():
        lock = lay.startswith("lockstep")
        print(
            f"  {lay:11s}: step {m['step'] * 1e3:6.1f} ms  generate {m['generate'] * 1e3:6.1f}  train {m['train'] * 1e3:6.1f}"
            f" (score {m['score'] * 1e3:5.1f})  weight_sync {m['weight_sync'] * 1e3:5.2f}  rollout_wait {m['rollout_wait'] * 1e3:5.1f}"
            f"  generate - sync - wait {m['unattributed'] * 1e3:5.1f}  critical path {cpu_per_step(runs[lay], not lock) * 1e3:5.1f} ms CPU/step"
        )
    base = next((x for x in agg if x.split("@")[0] == "colocated"), None)  # with --src: the first code's
    if base is None:
        return
    c0 = agg[base]
    for lay in [x for x in agg if not x.startswith("colocated")]:
        per_seed = [x["step"] / c["step"] for x, c in zip(med_of[lay], med_of[base], strict=True)]
        seeds = ", ".join(f"{r:.2f}" for r in per_seed)
        projected = cpu_per_step(runs[lay], not lay.startswith("lockstep")) / cpu_per_step(runs[base])
        print(
            f"  step time {lay} / {base}: {agg[lay]['step'] / c0['step']:.2f} measured (per seed, adjacent runs: {seeds});"
            f" {projected:.2f} projected for an idle machine (critical path's CPU/step over the colocated one's)"
        )
    g, t = c0["generate"], c0["train"]
    print(f"  colocated: generate / train = {g / t:.2f} ({g * 1e3:.1f} vs {t * 1e3:.1f} ms)")
    for lay in [x for x in agg if x.split("@")[0] == "async"]:
        t_async = agg[lay]["step"]
        hidden = (g + t - t_async) / min(g, t)
        print(
            f"  {lay}: hidden fraction of the shorter phase: (T_gen + T_train - T_async) / min(T_gen, T_train) = "
            f"({g * 1e3:.1f} + {t * 1e3:.1f} - {t_async * 1e3:.1f}) / {min(g, t) * 1e3:.1f} = {hidden:.2f}"
        )
        r = t_async / c0["step"]
        print(f"  goal {lay} / {base} <= 0.65: {'met' if r <= 0.65 else 'NOT met'} ({r:.2f} measured)")


def learning_summary(runs: dict[str, list[dict]]) -> None:
    """AUC per seed of each layout; (c) - (a) with Welch's t and a bootstrap CI; async's staleness."""
    aucs = {lay: [auc([r["reward"] for r in x["rows"]]) for x in rs] for lay, rs in runs.items()}
    print("\n[async_rollout] learning: area under the reward curve (mean reward over all steps), per seed")
    for lay, v in aucs.items():
        each = "  ".join(f"{x:.3f}" for x in v)
        print(f"  {lay:9s}: {each}   mean {mean(v):.3f} ± {sd(v):.3f}")
    if "colocated" in aucs and "async" in aucs and len(aucs["async"]) > 1:
        t, df = welch(aucs["async"], aucs["colocated"])
        lo, hi = bootstrap_ci(aucs["async"], aucs["colocated"])
        diff = mean(aucs["async"]) - mean(aucs["colocated"])
        equal = abs(t) < 2 and lo <= 0 <= hi
        print(
            f"  async - colocated: {diff:+.3f}, Welch t = {t:.2f} (df {df:.1f}), 95% bootstrap CI [{lo:+.3f}, {hi:+.3f}]: "
            f"{'equal within seed noise' if equal else 'NOT equal within seed noise'}"
        )
    if "async" in runs:
        rows = [r for x in runs["async"] for r in x["rows"][1:]]
        keys = ("rollout/staleness", *(f"sampling/importance_sampling_ratio/{x}" for x in ("mean", "min")))
        means = ", ".join(f"{k} mean {mean([r.get(k, 0) for r in rows]):.4f}" for k in keys)
        print(f"  async, steps 2..: {means}")


def sync_summary(runs: dict[str, list[dict]], med_of: dict[str, list[dict]]) -> None:
    """The measured push of this model, and a 7B's computed from its bytes and link bandwidths."""
    lay = next((x for x in runs if x.split("@")[0] == "async"), None)
    lay = lay or next((x for x in runs if x.split("@")[0] == "lockstep"), None)
    if lay is None:
        return
    params = safetensors_params(runs[lay][0]["out"] / "final")
    nbytes = params * 4  # fp32 training: the rollout rank holds fp32 weights
    sync = med([m["weight_sync"] for m in med_of[lay]])
    print("\n[async_rollout] weight push per optimizer step (timing/weight_sync)")
    if sync <= 0:
        print(f"  measured, {lay}: no push after the warm-up (too few steps)")
    else:
        print(
            f"  measured, {lay}: {params:,} parameters x 4 bytes (fp32) = {nbytes / 1e6:.2f} MB in {sync * 1e3:.2f} ms "
            f"(gloo over loopback, in the step: {nbytes / sync / 1e9:.2f} GB/s effective)"
        )
    seven = SEVEN_B * 2
    print(
        f"  computed, not measured: a 7B ({SEVEN_B:.2g} parameters) in bf16 = {seven / 1e9:.1f} GB; bytes / bandwidth:"
    )
    for link, (lo, hi) in LINKS.items():
        ms = f"{seven / hi * 1e3:.0f}-{seven / lo * 1e3:.0f} ms"
        print(f"    {link} {lo / 1e9:.0f}-{hi / 1e9:.0f} GB/s: {ms} per step")


def run_all(
    j: BenchJob, layouts: list[str], seeds: list[int], work: Path, srcs: dict[str, str] | None = None
) -> tuple[dict, dict]:
    """Job `j` in every layout (with `srcs`, every layout with each code: `LAYOUT@CODE`, adjacent), seed by
    seed (the first run rotates), one line per run."""
    srcs = srcs or {}
    layouts = [f"{lay}@{code}" for lay in layouts for code in srcs] if srcs else layouts
    (work / f"{j.name}.yaml").write_text(job_yaml(j))
    print(
        f"\n[async_rollout] job {j.name}: builtin:{j.model}, {j.batch} completions/step ({j.batch // j.generations} "
        f"prompts x {j.generations}), {j.tokens} tokens (min {j.min_tokens}), {j.reward}, lr {j.lr:g}, {j.steps} steps, "
        f"seeds {seeds}, layouts {layouts}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {lay: [] for lay in layouts}
    med_of: dict[str, list[dict]] = {lay: [] for lay in layouts}
    for i, seed in enumerate(seeds):
        order = layouts[i % len(layouts) :] + layouts[: i % len(layouts)]
        for lay in order:
            run = train(j, work, lay, seed, srcs.get(lay.partition("@")[2]))
            m = medians(run, j.warmup)
            runs[lay].append(run)
            med_of[lay].append(m)
            print_run(lay, seed, run, m)
    return runs, med_of


def main() -> None:
    a = parse_args()
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpufleet-async-rollout-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"[async_rollout] 1 torch thread per process (OMP_NUM_THREADS=1), {os.cpu_count()} CPUs; work {work}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start",
        flush=True,
    )
    timing, learn = jobs(a)
    if a.steps:  # --steps 0: the learning job alone
        runs, med_of = run_all(timing, a.layouts, a.seeds, work, a.src)
        timing_summary(timing, runs, med_of)
        for code in [f"@{c}" for c in a.src] or [""]:  # lock-step: the same samples and weights, figures
            pairs = zip(runs.get(f"colocated{code}", []), runs.get(f"lockstep{code}", []), strict=False)
            rows = [(x, y) for c, k in pairs for x, y in zip(c["rows"], k["rows"], strict=True)]
            if rows:
                worst = max(abs(x[key] - y[key]) for x, y in rows for key in ("reward", "entropy"))
                print(
                    f"  lockstep{code} vs colocated{code}, same seed: largest reward or entropy difference at any step {worst:.2g}"
                )
        sync_summary(runs, med_of)
    if a.learning:
        learned, _ = run_all(learn, [x for x in ("colocated", "async") if x in a.layouts], a.seeds, work)
        learning_summary(learned)
    print(f"\n[async_rollout] load average at the end {os.getloadavg()[0]:.2f}; runs and logs in {work}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints, words = (lambda s: [int(x) for x in s.split(",") if x]), (lambda s: [x for x in s.split(",") if x])
    ap.add_argument(
        "--steps", type=int, default=60, help="steps per timing run (default 60; 0: no timing job)"
    )
    ap.add_argument("--learn-steps", type=int, default=200, help="steps per learning run (default 200)")
    ap.add_argument(
        "--warmup", type=int, default=10, help="steps left out of the timing medians (default 10)"
    )
    ap.add_argument("--seeds", type=ints, default=[0, 1, 2], help="train.seed values, each in every layout")
    ap.add_argument("--layouts", type=words, default=list(LAYOUTS), help=f"a subset of {','.join(LAYOUTS)}")
    ap.add_argument("--model", default="tiny-qwen2", help="timing job: a built-in model (default tiny-qwen2)")
    ap.add_argument("--batch", type=int, default=16, help="timing job: completions per step (default 16)")
    ap.add_argument("--generations", type=int, default=8, help="timing job: completions per prompt (8)")
    ap.add_argument("--tokens", type=int, default=128, help="timing job: tokens of every completion (128)")
    ap.add_argument("--lr", type=float, default=3e-3, help="timing job: learning rate (default 3e-3)")
    ap.add_argument("--no-learning", dest="learning", action="store_false", help="skip the learning job")
    ap.add_argument("--out", default=None, help="work folder (default: a new /tmp folder)")
    code = "timing job: each layout also with the package in DIR (a `git archive` of a commit's src), as CODE"
    ap.add_argument("--src", action="append", default=[], metavar="CODE=DIR", help=code)
    a = ap.parse_args()
    if any("=" not in x for x in a.src):
        ap.error(f"--src takes CODE=DIR, got {a.src}")
    a.src = dict(x.split("=", 1) for x in a.src)
    unknown = [x for x in a.layouts if x not in LAYOUTS]
    if unknown or a.tokens < 2 or a.learn_steps < 2:
        ap.error(
            f"--layouts {unknown} not in {list(LAYOUTS)}"
            if unknown
            else "--tokens, --learn-steps must be >= 2"
        )
    return a


if __name__ == "__main__":
    sys.exit(main())
