"""`gpufleet train JOB --print-launch` prints a command that runs as printed: the resolved job it names is
written (and nothing else of the run directory is touched), and run from another folder it trains (2 gloo
processes, 2 steps) with the user's reward module next to the job file and a data file given by --set
relative to the working directory. Through the installed `gpufleet`, from folders outside the repository."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import run_user

JOB = """\
model:
  path: builtin:tiny-qwen2
reward:
  functions: [printlaunch_rewards:length]
algorithm:
  num_generations: 4
rollout:
  max_completion_length: 4
train:
  per_device_batch: 4
  max_steps: 2
  samples_every: 0
launch:
  nproc_per_node: 2
output:
  dir: runs/pl
  save_every: 0
monitor:
  device_interval: 0
"""

REWARDS = "def length(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n"


def _user(tmp_path: Path) -> tuple[Path, Path]:
    """A job folder (job.yaml + its reward module) and the folder the user works in (with prompts.jsonl)."""
    jobs, work = tmp_path / "jobs", tmp_path / "work"
    jobs.mkdir()
    work.mkdir()
    (jobs / "job.yaml").write_text(JOB)
    (jobs / "printlaunch_rewards.py").write_text(REWARDS)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{c}:"}) + "\n" for c in "abcd"))
    return jobs, work


def _printed(stdout: str) -> str:
    commands = [line for line in stdout.splitlines() if "torch.distributed.run" in line]
    assert len(commands) == 1, stdout
    return commands[0]


def _print(tmp_path: Path) -> tuple[Path, Path, str]:
    """`--print-launch` from the user's folder: (that folder, the run directory, the printed command)."""
    jobs, work = _user(tmp_path)
    p = run_user(
        "train",
        "../jobs/job.yaml",
        "--gpus",
        "cpu",
        "--print-launch",
        "--set",
        "data.path=prompts.jsonl",
        cwd=work,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return work, work / "runs" / "pl", _printed(p.stdout)


def test_printed_command_names_files_that_exist(tmp_path, monkeypatch):
    work, out, command = _print(tmp_path)
    printed = out / "print-launch" / "job.yaml"
    assert command.startswith(f"cd {work} && ") and "--standalone" in command, command
    assert command.endswith(" --worker runs/pl/print-launch/job.yaml --gpus cpu"), command
    assert printed.is_file() and sorted(x.name for x in out.iterdir()) == ["print-launch"]
    assert not (out / "job.yaml").exists()  # a printed command is not a run: output.resume never still passes
    path = command.split("PYTHONPATH=", 1)[1].split(" ", 1)[0]
    assert path.split(os.pathsep)[:2] == [str(tmp_path / "jobs"), str(work)]
    # what the worker reads, as it reads it (in the command's folder, with its PYTHONPATH): every rule passes,
    # and the data file --set gave relative to that folder is the user's, not one beside the job file
    from gpufleet.config.load import load_job
    from gpufleet.hardware import resolve_hardware
    from gpufleet.rules import run_checks

    monkeypatch.chdir(work)
    for folder in reversed(path.split(os.pathsep)):
        monkeypatch.syspath_prepend(folder)
    r = load_job(printed, env={}, anchor=False)
    assert r.job.data.path == "prompts.jsonl" and r.job.reward.functions == ["printlaunch_rewards:length"]
    problems, ctx = run_checks(r, resolve_hardware("cpu", {}), {})
    assert not [p for p in problems if p.severity == "error"], [p.render() for p in problems]
    assert ctx.topo.world_size == 2


@pytest.mark.slow
def test_printed_command_runs_from_another_folder(tmp_path):
    work, out, command = _print(tmp_path)
    printed = out / "print-launch" / "job.yaml"
    elsewhere = tmp_path / "elsewhere"  # where the user's shell happens to be
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") or k == "PYTHONPATH")}
    ran = subprocess.run(
        ["bash", "-c", command], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=240
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["reward"] > 0 for s in steps)  # the user's reward
    assert (out / "final").is_dir() and (out / "job.yaml").read_text() == printed.read_text()
    assert not any(elsewhere.iterdir())  # the command starts in the launcher's folder: nothing lands here


def test_print_launch_leaves_an_existing_run_alone(tmp_path):
    jobs, work = _user(tmp_path)
    out = work / "runs" / "pl"
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    before = {"job.yaml": "old job\n", "metrics.jsonl": '{"step": 1}\n', "checkpoints/step-1/x": "weights"}
    for name, text in before.items():
        (out / name).write_text(text)
    for _ in range(2):  # written again over its own file
        p = run_user("train", "../jobs/job.yaml", "--gpus", "cpu", "--print-launch", cwd=work)
        assert p.returncode == 0, p.stdout + p.stderr
    for name, text in before.items():
        assert (out / name).read_text() == text
    assert sorted(x.name for x in (out / "print-launch").iterdir()) == ["job.yaml"]  # no temporary left
    assert _printed(p.stdout).endswith("--worker runs/pl/print-launch/job.yaml --gpus cpu")
