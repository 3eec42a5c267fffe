"""bench/async_rollout.py at its smallest: the three layouts train once each (real `gpufleet train`
processes, a rollout rank on a second process) and the summary is printed. No assertion on time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_async_rollout_bench_runs_its_smallest_configuration(tmp_path):
    argv = [sys.executable, str(ROOT / "bench" / "async_rollout.py"), "--out", str(tmp_path)]
    # 2 prompts x 8 at seed 0: step 1 has rewards to learn from, so lock-step's check sees trained weights
    argv += ["--steps", "3", "--warmup", "1", "--seeds", "0", "--learn-steps", "2"]
    argv += ["--batch", "16", "--tokens", "8"]
    argv += ["--layouts", "colocated,lockstep,async"]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for layout in ("colocated", "lockstep", "async"):
        assert f"{layout:9s} seed 0: step" in out, out
    assert "step time async / colocated:" in out and "hidden fraction of the shorter phase" in out
    same = out.split("largest reward or entropy difference at any step ")[1].split()[0]
    assert float(same) <= 1e-6, out  # lock-step samples and trains as colocated
    assert "rollout/staleness mean 1.0000" in out  # one step behind from the second step on
    assert "computed, not measured: a 7B" in out and "area under the reward curve" in out
    assert (tmp_path / "runs" / "learn-async-seed0" / "metrics.jsonl").read_text().count("\n") == 2
