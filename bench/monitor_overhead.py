"""What monitoring costs on the quickstart job, measured side by side (no assertions).

    .venv/bin/python bench/monitor_overhead.py [--steps 20] [--pairs 2]

1. The device sampler: `gpufleet train examples/quickstart.yaml` for --steps steps, alternately with
   monitor.device_interval=1 (the default) and 0 (no sampler), --pairs runs each, interleaved so that
   both see the same machine load; the median step time of each (each run's first 3 steps dropped:
   warm-up) and the ratio on / off.
2. The phase clock (always on; it cannot be switched off): the phases entered in real steps (the
   trainer run in-process with a counting clock) times the measured cost of entering and leaving one
   phase, as a share of the step time.
3. The sampler's own work: the CPU time of one sample (psutil over this process's tree, no NVML on a
   CPU-only machine), i.e. its share of one core at one sample a second; on a loaded machine this is
   steadier than the side-by-side ratio of 1.

Goal (issue 11): both under 2% of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "examples" / "quickstart.yaml")
WARMUP = 3


def run_steps(out: Path, steps: int, interval: float) -> list[float]:
    argv = [sys.executable, "-m", "gpufleet", "train", JOB, "--gpus", "cpu"]
    for s in (f"train.max_steps={steps}", "output.save_every=0", f"monitor.device_interval={interval}"):
        argv += ["--set", s]
    argv += ["--set", f"output.dir={out}"]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step_time"] for x in lines][WARMUP:]


def sampler(steps: int, pairs: int, tmp: Path) -> None:
    on, off = [], []
    for i in range(pairs):
        on += run_steps(tmp / f"on{i}", steps, 1.0)
        off += run_steps(tmp / f"off{i}", steps, 0.0)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"sampler on  (1 s): median step {m_on * 1000:8.1f} ms over {len(on)} steps")
    print(f"sampler off      : median step {m_off * 1000:8.1f} ms over {len(off)} steps")
    print(f"ratio on / off   : {m_on / m_off:.4f}  ({(m_on / m_off - 1) * 100:+.2f}%; goal < +2%)")


def clock(steps: int, tmp: Path) -> None:
    from gpufleet import dist
    from gpufleet.config.load import load_job
    from gpufleet.hardware import cpu_hardware
    from gpufleet.monitor.timing import PhaseClock
    from gpufleet.rl.trainer import train
    from gpufleet.topology import resolve_topology

    class Counting(PhaseClock):
        entered = 0

        def phase(self, name):
            Counting.entered += 1
            return super().phase(name)

    r = load_job(JOB, [f"train.max_steps={steps}", "output.save_every=0", f"output.dir={tmp / 'clock'}"], {})
    rt = dist.init(resolve_topology(r, cpu_hardware())[0], cpu=True)
    rt.clock = Counting()
    last = train(r.job, tmp / "clock", rt, log=lambda *_: None)
    per_step = Counting.entered / steps
    probe, n = PhaseClock(), 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        with probe.phase("comm"):
            pass
    cost = (time.perf_counter() - t0) / n
    share = per_step * cost / last["step_time"]
    print(
        f"phase clock      : {per_step:.0f} phases/step x {cost * 1e6:.2f} us = {per_step * cost * 1e6:.0f} us"
    )
    print(f"                   of a {last['step_time'] * 1000:.1f} ms step: {share * 100:.4f}% (goal < 2%)")


def sample_cost(n: int = 200) -> None:
    from gpufleet.monitor.devices import DeviceSampler

    s = DeviceSampler(Path("/dev/null"), 1.0, {0: ("policy", None)}, in_process=True, nvml=False)
    s.sample()
    t0 = time.process_time()
    for _ in range(n):
        s.sample()
    cost = (time.process_time() - t0) / n
    print(f"one device sample: {cost * 1000:.2f} ms CPU = {cost * 100:.2f}% of one core at 1 sample/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-monitor-bench-") as tmp:
        sampler(args.steps, args.pairs, Path(tmp))
        clock(min(args.steps, 5), Path(tmp))
    sample_cost()


if __name__ == "__main__":
    main()
