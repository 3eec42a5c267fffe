"""Where one gpufleet training step's GPU time goes (issue 37, item 3): the torch profiler over one step of a
`vs_trl.py` preset's job, each phase of the step (`monitor/timing.py`: generate, score, backward, ...) as a
profiler range, so the table shows per phase the host's time beside the GPU's, then the kernels.

    python3 bench/gpu_step_profile.py --device cuda --preset gpu-long --completion 256
    .venv/bin/python bench/gpu_step_profile.py --device cpu --preset speed      # the same tables, here

The job is `gpufleet_run.job_sets`' (the benchmark's own settings, bf16 on a GPU); the first step runs
unprofiled (warm-up: compilation, CUDA graphs, the allocator), the second under the profiler. A phase whose
host time is far above its GPU time is bound by the host (launches, synchronisations, Python).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import torch
from gpufleet_run import job_sets
from measure import PRESETS


def phases_as_ranges() -> None:
    """Make every `PhaseClock.phase` also a profiler range named `phase/<name>` (this process only)."""
    from gpufleet.monitor import timing

    plain = timing.PhaseClock.phase

    @contextlib.contextmanager
    def phase(self, name: str):
        with plain(self, name), torch.profiler.record_function(f"phase/{name}"):
            yield

    timing.PhaseClock.phase = phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--preset", default="gpu-long")
    ap.add_argument("--completion", type=int, default=None, help="completion tokens (default: the preset's)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    p = PRESETS[a.preset]
    if a.completion:
        p = replace(p, completion_tokens=a.completion)
    gpu = a.device == "cuda"
    from gpufleet.config.load import load_job
    from gpufleet.dist import Runtime
    from gpufleet.rl.trainer import train

    phases_as_ranges()
    out = Path(tempfile.mkdtemp(prefix="gpufleet-step-profile-"))
    run = Namespace(lr=p.lr, steps=3, seed=42, precision="bf16" if gpu else "fp32")
    job = load_job(None, job_sets(run, p, out / "run") + ["output.save_every=0"], env={}).job
    rt = Runtime(device=torch.device(a.device, 0) if gpu else torch.device("cpu"))
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if gpu else []
    )
    # steps: 1 unprofiled (warm-up), 2 profiled, 3 unprofiled (its end holds the final save)
    schedule = torch.profiler.schedule(wait=1, warmup=0, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True) as prof:
        train(job, out / "run", rt, log=lambda _line: prof.step())
    events = prof.key_averages()
    key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    print(f"--- {a.preset}, {p.batch} x {p.completion_tokens} tokens, {a.device}: the step's phases")
    for e in sorted((e for e in events if e.key.startswith("phase/")), key=lambda e: e.key):
        device_us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        print(f"  {e.key:20s} host {e.cpu_time_total / 1e3:9.1f} ms   device {device_us / 1e3:9.1f} ms")
    print(events.table(sort_by=key, row_limit=a.top, max_name_column_width=110), flush=True)
    # the host's side: which ops are issued most often, by input shape (each a kernel launch on a GPU)
    by_shape = prof.key_averages(group_by_input_shape=True)
    print(
        by_shape.table(sort_by="count", row_limit=a.top, max_name_column_width=40, max_shapes_column_width=90)
    )


if __name__ == "__main__":
    main()
