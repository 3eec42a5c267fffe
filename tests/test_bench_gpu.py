"""bench/on_gpu.sh, the script a lent GPU runs (issue 37), on the CPU at small shapes (``DEVICE=cpu``): it
must keep working between the sessions that have a GPU, as they have minutes to spend, not to debug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_script_prints_its_decode_table_and_step_profile_on_the_cpu(tmp_path):
    env = dict(
        os.environ,
        DEVICE="cpu",
        PY=sys.executable,
        OUT=str(tmp_path / "out"),
        WORK=str(tmp_path / "work"),
        PARTS="decode profile",
        DECODE_ARGS="--rows 4 --new 12 --variants graph,+compile --hf-rows 4 --profile tiny-qwen2:4:graph",
        PROFILE_ARGS="--preset speed --top 5",
    )
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "on_gpu.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "tiny-qwen2: decoder vs HF forward" in out and "HF generate" in out, out[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("tiny-qwen2") and "%" in line]
    assert len(rows) == 3, out[-3000:]  # graph, +compile, HF generate at 4 rows
    assert "phase/generate" in out and "phase/backward" in out, out[-3000:]
    assert (tmp_path / "out" / "gpu_decode.json").is_file()
