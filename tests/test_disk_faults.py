"""File-system faults while training: a disk that fills up while a checkpoint is written. Nothing
already written is lost, the partial checkpoint is removed (it would keep the disk full), the user
reads one line that says "no space" with the numbers, exit 2, and a re-run with space resumes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import run_user

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_disk(tmp_path):
    """A real 1.6 MiB file system (tmpfs): one tiny-model checkpoint fits, a second does not."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mnt)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {p.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow  # ~20 s: keeps `make test` under 8 minutes; CI runs it with the slow tests
def test_disk_full_while_checkpointing(small_disk, tmp_path):
    run = small_disk / "run"
    args = [
        "train",
        str(ROOT / "examples" / "quickstart.yaml"),
        "--gpus",
        "cpu",
        "--set",
        f"output.dir={run}",
    ]
    args += ["--set", "train.max_steps=4", "--set", "output.save_every=1", "--set", "train.samples_every=0"]
    p = run_user(*args, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    err = [x for x in p.stderr.splitlines() if x.startswith("gpufleet: error:")]
    assert len(err) == 1 and "no space left on" in err[0] and str(small_disk) in err[0], p.stderr
    assert "MiB free" in err[0] and "checkpoint needs" in err[0]
    ckpts = run / "checkpoints"
    assert not list(ckpts.glob(".tmp-*")), list(ckpts.iterdir())  # the partial files are gone
    assert (ckpts / "latest").read_text() == "step-1" and (ckpts / "step-1" / "trainer_state.json").is_file()
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    p = run_user(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from" in p.stdout and "(step 1)" in p.stdout
    assert (run / "final" / "model.safetensors").is_file()
