"""The trainer's progress line: its s/step is the rate its ETA uses (the mean since the start), not the
last step's time (20 steps that took 109 s once printed 0.78 s/step beside an ETA of minutes)."""

from __future__ import annotations

import io

from gpufleet.monitor.metrics import Progress

LAST = {"reward": 0.5, "reward_std": 0.1, "kl": 0.0, "completions/mean_length": 8.0, "loss": 0.0}


def test_progress_line_s_per_step_is_the_etas_rate():
    p = Progress(total=100, out=io.StringIO())
    p.t0 -= 109.0  # 20 steps took 109 s, the last of them 0.78 s
    line = p.line(20, {**LAST, "step_time": 0.78})
    assert "5.45s/step" in line and "0.78" not in line, line
    assert "elapsed 1:49" in line and "eta 7:16" in line, line  # 80 steps x 5.45 s
    resumed = Progress(total=100, start=50, out=io.StringIO())  # a resumed run counts its own steps
    resumed.t0 -= 20.0
    assert "2.00s/step" in resumed.line(60, {**LAST, "step_time": 0.5})
