"""`gpufleet launch` runs the command the user wrote and shows it (issue 34 section 3): an explicit
interpreter is the one that runs, a bare `python` is the one on PATH, a substitution is said; the failing
rank's exception is in the summary after init_process_group (torch's `[rank1]:` prefixes); every rank's
stderr is on the terminal; a job-less launch gets a folder of its own; OUTPUT/launch.json records it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import run_user

WHICH = "import os, sys\nprint('interpreter', os.environ.get('WHICH_PYTHON', 'not mine'), sys.executable, flush=True)\n"


def interpreter(home: Path) -> Path:
    """A user's own `python` (a wrapper that marks its ranks, then runs a real Python)."""
    bin_dir = home / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexport WHICH_PYTHON=mine\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.mark.slow
def test_the_interpreter_the_user_names_is_the_one_that_runs(tmp_path):
    python = interpreter(tmp_path)
    (tmp_path / "which.py").write_text(WHICH)
    flags = ["launch", "--gpus", "cpu", "--nproc", "1", "--set", "output.dir=run"]
    p = run_user(*flags, "--", str(python), "which.py", cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"gpufleet launch: {python} which.py" in p.stdout and "interpreter mine" in p.stdout, p.stdout
    assert json.loads((tmp_path / "run" / "launch.json").read_text())["command"] == [str(python), "which.py"]

    on_path = {"PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}  # the user's venv, activated
    p = run_user(*flags, "--", "python", "which.py", cwd=tmp_path, env_extra=on_path, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"program: {python} (python on PATH)" in p.stdout and "interpreter mine" in p.stdout, p.stdout

    nowhere = {"PATH": str(tmp_path / "empty")}  # no python on PATH at all: gpufleet's own, and it says so
    p = run_user(*flags, "--", "python", "which.py", cwd=tmp_path, env_extra=nowhere, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"python is not on PATH: the ranks run gpufleet's own Python, {sys.executable}" in p.stdout
    assert f"interpreter not mine {sys.executable}" in p.stdout, p.stdout


FAILS = """
import sys, torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} warns", file=sys.stderr, flush=True)
if dist.get_rank() == 1:
    raise ValueError("bad value on rank one")
dist.barrier()
"""

RECIPE_JOB = """
script:
  command: python fails.py --bs {per_device_batch}
  per_device_batch: 8
  learning_rate: 0.01
"""


@pytest.mark.slow
def test_the_exception_every_stderr_and_launch_json(tmp_path):
    (tmp_path / "fails.py").write_text(FAILS)
    (tmp_path / "job.yaml").write_text(RECIPE_JOB)
    p = run_user("launch", "job.yaml", "--gpus", "cpu", "--nproc", "2", cwd=tmp_path, timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "gpufleet: rank 1 failed first: ValueError: bad value on rank one" in p.stderr, p.stderr
    assert "rank 0 warns" in p.stderr and "[rank 1] rank 1 warns" in p.stderr  # both ranks' stderr, live
    assert "[rank1]: ValueError: bad value on rank one" in p.stderr  # torch's own prefix, not doubled
    (run,) = (tmp_path / "runs").iterdir()  # no output.dir: a folder of this launch's own
    assert run.name.startswith("launch-") and f"run folder: runs/{run.name} (new for this launch" in p.stdout
    record = json.loads((run / "launch.json").read_text())
    assert record["command"] == ["python", "fails.py", "--bs", "4"] and record["nproc"] == 2
    assert record["program"] == str(Path(sys.executable).parent / "python")
    assert record["recipe"]["now"]["per_device_batch"] == 4 and record["recipe"]["reference"]["devices"] == 1
    assert record["env"]["GPUFLEET_PER_DEVICE_BATCH"] == "4" and record["nnodes"] == 1
    assert record["started"][:4].isdigit() and record["logs"] == str(run / "logs")

    p = run_user("launch", "job.yaml", "--gpus", "cpu", "--nproc", "2", cwd=tmp_path, timeout=180)
    assert p.returncode == 1 and len(list((tmp_path / "runs").iterdir())) == 2  # the first run's logs kept
