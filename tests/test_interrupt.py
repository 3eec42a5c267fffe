"""Stopping a run: Ctrl-C (SIGINT to the process group, as a terminal sends it) or SIGTERM ends every
rank, exits 130 with one line saying where the last checkpoint is, and a re-run resumes from it; a
launcher killed with SIGKILL leaves no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")

pytestmark = pytest.mark.slow


def start(run: Path, *sets: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])
    argv = [sys.executable, "-m", "gpufleet", "train", QUICK, "--gpus", "cpu", "--set", f"output.dir={run}"]
    for s in ("train.max_steps=400", "output.save_every=2", "train.log_every=1", *sets):
        argv += ["--set", s]
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def wait_for_checkpoint(p: subprocess.Popen, run: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (run / "checkpoints" / "latest").exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)


def processes_of(run: Path) -> list[int]:
    """Live processes whose command line names the run (launcher, torchrun agent, workers)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next(x for x in (d / "status").read_text().splitlines() if x.startswith("State:"))
            except (OSError, StopIteration):
                continue
            if str(run) in cmd and "Z" not in state.split()[1]:
                pids.append(int(d.name))
    return pids


def gone(run: Path, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not processes_of(run)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_stops_every_rank_and_says_how_to_resume(tmp_path, nproc):
    run = tmp_path / "run"
    p = start(run, f"launch.nproc_per_node={nproc}", "train.per_device_batch=8")
    wait_for_checkpoint(p, run)
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, err = p.communicate(timeout=90)
    assert p.returncode == 130, out + err
    assert "Traceback" not in out + err and "failed" not in err, err
    line = [x for x in err.splitlines() if x.startswith("gpufleet: interrupted")]
    assert len(line) == 1, err
    assert "Last checkpoint:" in line[0] and "run the same command again to resume" in line[0]
    assert gone(run), processes_of(run)
    at = int(line[0].split("(step ")[1].split(")")[0])
    more = f"train.max_steps={at + 2}"
    again = start(run, f"launch.nproc_per_node={nproc}", "train.per_device_batch=8", more)
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0, out + err
    assert out.count("resuming from") == 1 and (run / "final" / "model.safetensors").is_file()


def test_sigterm_to_the_launcher_alone_stops_every_rank(tmp_path):
    run = tmp_path / "run"
    p = start(run, "launch.nproc_per_node=2", "train.per_device_batch=8")
    wait_for_checkpoint(p, run)
    p.send_signal(signal.SIGTERM)  # e.g. a job scheduler's stop, sent to the launcher's pid only
    out, err = p.communicate(timeout=90)
    assert p.returncode == 130, out + err
    assert "gpufleet: interrupted" in err and "Traceback" not in err
    assert gone(run), processes_of(run)


def test_sigkill_of_the_launcher_leaves_no_orphan(tmp_path):
    run = tmp_path / "run"
    p = start(run, "launch.nproc_per_node=2", "train.per_device_batch=8")
    wait_for_checkpoint(p, run)
    assert len(processes_of(run)) >= 4  # launcher, torchrun agent, two workers
    p.kill()  # SIGKILL: no handler runs in the launcher
    p.communicate(timeout=30)
    assert gone(run), processes_of(run)
