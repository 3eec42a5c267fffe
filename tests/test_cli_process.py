"""The CLI as a user runs it: real processes, exit codes, no torch import on check/config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")


def run(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=e, cwd=ROOT, timeout=120
    )


def test_python_dash_m_check_ok():
    p = run("-m", "gpufleet", "check", QUICK, "--gpus", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ok: no problems found." in p.stdout


def test_issue_example_exits_2():
    p = run(
        "-m",
        "gpufleet",
        "check",
        QUICK,
        "--set",
        "train.per_device_batch=4",
        "--set",
        "algorithm.num_generations=3",
        "--set",
        "launch.nproc_per_node=4",
        "--gpus",
        "4x24GB",
    )
    assert p.returncode == 2
    assert (
        "algorithm.num_generations" in p.stdout
        and "generation batch" in p.stdout
        and "16 completions" in p.stdout
    )
    assert "valid for 16: 2, 4, 8, 16" in p.stdout and "per_device_batch=3" in p.stdout


def test_env_layer_in_a_real_process():
    p = run(
        "-m", "gpufleet", "config", QUICK, "--format", "json", env={"GPUFLEET_TRAIN__PER_DEVICE_BATCH": "4"}
    )
    assert p.returncode == 0, p.stderr
    assert '"source": "env GPUFLEET_TRAIN__PER_DEVICE_BATCH"' in p.stdout


def test_check_and_config_import_no_torch():
    code = (
        "import sys\n"
        "from gpufleet.cli import main\n"
        f"assert main(['check', {QUICK!r}, '--gpus', '4x24GB']) == 0\n"
        f"assert main(['config', {QUICK!r}]) == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    p = run("-c", code)
    assert p.returncode == 0, p.stdout + p.stderr


def test_usage_error_exit_2():
    p = run("-m", "gpufleet", "check")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    p = run("-m", "gpufleet", "frobnicate")
    assert p.returncode == 2
