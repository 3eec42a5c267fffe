"""`gpufleet watch` and `gpufleet report` of a `gpufleet launch`ed script: a real launch of a script on 2
processes (its progress lines, each rank's output, the device sampler), watched while it runs and after;
the resolved launch (launch.json) read when the run folder has it (a recorded one where it does not)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import console_script, process_env, run_user
from test_monitor_report import CHROMIUM, PROBE, chromium

SCRIPT = """
import os, sys, time
rank, batch = int(os.environ["RANK"]), int(os.environ["GPUFLEET_EFFECTIVE_BATCH"])
data = bytearray(50 * 1024 * 1024)  # held, so each rank's peak memory is plain to see
for step in range(int(os.environ["GPUFLEET_MAX_STEPS"])):
    time.sleep(0.1)
    if rank == 0:
        print(f"gpufleet-progress samples={(step + 1) * batch}", flush=True)
print(f"rank {rank} done after {step + 1} steps", flush=True)
"""

JOB = """
script:
  command: python work.py --bs {per_device_batch}
  per_device_batch: 4       # on 1 device; 2 each on 2
  learning_rate: 0.01
  max_steps: 40
monitor:
  device_interval: 0.2
output:
  dir: run
"""

RECORDED = {  # what `gpufleet launch` saves (launch/scriptrun.py), for a run folder that lacks it
    "command": ["python", "work.py", "--bs", "2"],
    "nproc": 2,
    "nnodes": 1,
    "recipe": {
        "batch_rule": "keep_effective_batch",
        "lr_rule": "none",
        "reference": {
            "devices": 1,
            "per_device_batch": 4,
            "gradient_accumulation_steps": 1,
            "effective_batch": 4,
            "learning_rate": 0.01,
            "max_steps": 40,
        },
        "now": {
            "devices": 2,
            "per_device_batch": 2,
            "gradient_accumulation_steps": 1,
            "effective_batch": 4,
            "learning_rate": 0.01,
            "max_steps": 40,
        },
    },
    "env": {"GPUFLEET_PER_DEVICE_BATCH": "2", "GPUFLEET_MAX_STEPS": "40", "GPUFLEET_EFFECTIVE_BATCH": "4"},
    "started": "2026-11-27T12:00:00+0000",
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, str]:
    """A real launch on 2 CPU processes, and `watch --once` taken while it ran."""
    home = tmp_path_factory.mktemp("views") / "me"
    home.mkdir()
    (home / "job.yaml").write_text(JOB)
    (home / "work.py").write_text(SCRIPT)
    argv = [console_script(), "launch", "job.yaml", "--gpus", "cpu", "--nproc", "2"]
    proc = subprocess.Popen(
        argv, cwd=home, env=process_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    progress, during = home / "run" / "logs" / "progress.jsonl", ""
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            if progress.exists() and len(progress.read_text().splitlines()) >= 5:
                during = run_user("watch", "run", "--once", cwd=home).stdout
                break
            time.sleep(0.1)
        out = proc.communicate(timeout=120)[0].decode()
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    return home / "run", during


def test_watch_while_it_runs_shows_samples_per_second_and_eta(launched):
    _, during = launched
    head = during.splitlines()[0]
    assert re.search(r"run  launched script  samples \d+/160 \(\d+%\)  [\d.]+ samples/s  eta 0:\d\d", head), (
        during
    )
    assert "samples/s" in during and "ranks (last line)" in during and "rank 0 worker" in during
    assert "% cpu" in during and "nans/step" not in during and "step 0/?" not in during


def test_watch_of_the_finished_launch(launched):
    run, _ = launched
    p = run_user("watch", str(run), "--once", cwd=run.parent)
    assert p.returncode == 0, p.stderr
    head = p.stdout.splitlines()[0]
    assert re.search(r"samples 160/160 \(100%\)  [\d.]+ samples/s  finished", head), p.stdout
    assert "rank 0 done after 40 steps" in p.stdout and "rank 1 done after 40 steps" in p.stdout
    # the devices panel of a run that has ended: each rank's peak, not the sample taken after the exit
    assert "devices (the run is over: peaks over the run)" in p.stdout
    rss = [float(x) for x in re.findall(r"rank \d worker .* ([\d.]+) GiB rss", p.stdout)]
    assert len(rss) == 2 and min(rss) >= 0.05, p.stdout  # the 50 MiB each rank held
    assert "0.00 GiB rss" not in p.stdout


def with_launch_json(run: Path, dest: Path) -> Path:
    """A copy of the run with its launch.json, or the recorded one where the launcher wrote none."""
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("report"))
    if not (dest / "launch.json").exists():
        (dest / "launch.json").write_text(json.dumps(RECORDED))
    return dest


def test_launch_json_gives_progress_recipe_and_eta(launched, tmp_path):
    run = with_launch_json(launched[0], tmp_path / "half")
    launch = json.loads((run / "launch.json").read_text())
    lines = (run / "logs" / "progress.jsonl").read_text().splitlines()
    (run / "logs" / "progress.jsonl").write_text("\n".join(lines[:20]) + "\n")  # as it was half-way
    devices = (run / "devices.jsonl").read_text().splitlines()
    alive = [json.loads(x) for x in devices if any(r["pids"] for r in json.loads(x)["ranks"])]
    for rec in alive:  # the ranks still running: pids that live (watch asks this machine whether they do)
        rec["ranks"] = [{**r, "pids": [os.getpid()]} for r in rec["ranks"]]
    (run / "devices.jsonl").write_text("".join(json.dumps(x) + "\n" for x in alive))
    p = run_user("watch", str(run), "--once", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert re.search(r"samples 80/160 \(50%\)  [\d.]+ samples/s  eta 0:0\d", p.stdout), p.stdout
    assert " ".join(launch["command"]) in p.stdout and "2 per node x 1 node(s)" in p.stdout
    assert re.search(r"per-device batch +│ 2 +\(reference 4\)", p.stdout), p.stdout
    assert "GPUFLEET_PER_DEVICE_BATCH=2" in p.stdout and "the run is over" not in p.stdout


def test_report_of_a_launched_script(launched, tmp_path):
    run = with_launch_json(launched[0], tmp_path / "full")
    p = run_user("report", str(run), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    page = (run / "report" / "index.html").read_text()
    assert re.search(
        r"<td>160 samples of 160</td><td>-</td><td>-</td><td>[\d.]+ samples/s</td><td>CPU, 2 ranks", page
    )
    assert "Launched script: full" in page and "<td>per-device batch</td><td>4</td><td>2</td>" in page
    assert "<td>GPUFLEET_PER_DEVICE_BATCH</td><td>2</td>" in page
    assert "<td>1</td><td>rank 1 done after 40 steps</td>" in page
    assert 'id="fig-progress"' in page and 'id="fig-devices"' in page
    assert "no job.yaml" not in page and "Plan vs measured" not in page
    assert sorted(x.name for x in (run / "report").glob("*.png")) == ["devices.png", "progress.png"]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (`make test` installs it when root)")
def test_report_of_a_launched_script_in_a_real_browser(launched, tmp_path):
    run = with_launch_json(launched[0], tmp_path / "browser")
    assert run_user("report", str(run), cwd=tmp_path).returncode == 0
    index = run / "report" / "index.html"
    dom, console = chromium(index)
    assert console == [] and 'id="fig-progress"' in dom and "Launched script: browser" in dom
    probe = index.with_name("probe.html")
    probe.write_text(index.read_text().replace("</body>", PROBE + "</body>"))
    dom, console = chromium(probe)
    widths = [int(w) for w in re.search(r'data-widths="([\d,]+)"', dom).group(1).split(",")]
    assert len(widths) == 2 and min(widths) > 500 and console == []  # progress.png, devices.png decode


def test_watch_of_a_script_that_failed_before_its_first_progress_line(tmp_path):
    """Rank 1 raises at once: watch says which rank failed with its exit code and its last line (the
    error), not that no progress line came yet."""
    home = tmp_path / "me"
    home.mkdir()
    (home / "job.yaml").write_text(JOB)
    (home / "work.py").write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise SystemExit('bad config: data.csv not found')\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run(
        [console_script(), "launch", "job.yaml", "--gpus", "cpu", "--nproc", "2"],
        cwd=home, env=process_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout + done.stderr
    p = run_user("watch", "run", "--once", cwd=home)
    words = " ".join(p.stdout.split())  # the header may wrap at the terminal's width
    assert "no progress lines yet" not in words, p.stdout
    assert re.match(r"run launched script failed before its first progress line: rank 1 exit 1: bad config: "
                    r"data\.csv not found", words), p.stdout  # fmt: skip
