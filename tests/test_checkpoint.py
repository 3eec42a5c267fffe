"""Checkpoints with real processes: kill -9 and resume exactly, kills during a checkpoint write,
torchrun restarts, continuity checks, export, and loading without pickled code."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpufleet import checkpoint, continuity
from helpers import process_env

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")
ARGS = [
    "--gpus",
    "cpu",
    "--set",
    "train.per_device_batch=32",
    "--set",
    "train.log_every=1",
    "--set",
    "reward.functions=repeat/chars,mp_rewards:length",
    "--set",
    "reward.weights=null",
]


def env(**extra) -> dict:
    return process_env(**extra)


def argv(run: Path, *sets: str) -> list[str]:
    out = [sys.executable, "-m", "gpufleet", "train", QUICK, *ARGS, "--set", f"output.dir={run}"]
    for s in sets:
        out += ["--set", s]
    return out


def train(run: Path, *sets: str, timeout=300, **extra) -> subprocess.CompletedProcess:
    p = subprocess.run(
        argv(run, *sets), capture_output=True, text=True, env=env(**extra), cwd=ROOT, timeout=timeout
    )
    return p


def start(run: Path, *sets: str, **extra) -> subprocess.Popen:
    log = (run.parent / f"{run.name}.{time.time_ns()}.log").open("w")
    return subprocess.Popen(
        argv(run, *sets),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env(**extra),
        cwd=ROOT,
        start_new_session=True,
    )


def kill9(proc: subprocess.Popen) -> None:
    """kill -9 the whole process group (launcher, torchrun, workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def wait_for(predicate, timeout=120.0, proc=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(0.02)
    raise AssertionError("timed out waiting")


def steps_logged(run: Path) -> int:
    f = run / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


def test_kill9_then_resume_is_bitwise_identical(tmp_path):
    sets = ("train.max_steps=10", "output.save_every=3")
    ref = tmp_path / "ref"
    assert train(ref, *sets).returncode == 0
    run = tmp_path / "run"
    kill_at = random.Random().randint(4, 9)
    proc = start(run, *sets)
    wait_for(lambda: steps_logged(run) >= kill_at, proc=proc)
    kill9(proc)
    assert not (run / "final").exists()
    p = train(run, *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from" in p.stdout
    a, b = final_weights(ref), final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a), f"killed at step {kill_at}"
    ra = [json.loads(x)["reward"] for x in (ref / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x)["reward"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert ra == rb  # the metrics file was cut back to the checkpoint, then continued identically


@pytest.mark.slow
def test_adaptive_entropy_kill9_then_resume_is_bitwise_identical(tmp_path):
    """The adaptive entropy coefficient (and the last step's entropy that gates it) survive kill -9: the
    resumed run continues bit for bit, its coefficient included. Target 10 nats: the tiny model sits below
    it, so the bonus is on from step 2 and the coefficient grows every step; top 50% entropy tokens."""
    sets = (
        "train.max_steps=8",
        "output.save_every=3",
        "algorithm.use_adaptive_entropy=true",
        "algorithm.entropy_coef=0.01",
        "algorithm.entropy_coef_delta=0.02",
        "algorithm.entropy_target=10",
        "algorithm.top_entropy_quantile=0.5",
    )
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *sets).returncode == 0
    kill_at = random.Random().randint(4, 7)
    proc = start(run, *sets)
    wait_for(lambda: steps_logged(run) >= kill_at, proc=proc)
    kill9(proc)
    assert not (run / "final").exists()
    saved = checkpoint.load_state(run / "checkpoints" / "step-3")
    assert saved.controllers["entropy"]["entropy_coef"] == pytest.approx(0.01 + 3 * 0.02)
    p = train(run, *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from" in p.stdout
    a, b = final_weights(ref), final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a), f"killed at step {kill_at}"
    coef = [
        [json.loads(x)["entropy_coef"] for x in (r / "metrics.jsonl").read_text().splitlines()]
        for r in (ref, run)
    ]
    assert coef[0] == coef[1] == pytest.approx([0.01 + 0.02 * k for k in range(1, 9)])


@pytest.mark.slow
def test_kill9_two_ranks_then_resume(tmp_path):
    sets = (
        "train.max_steps=8",
        "output.save_every=2",
        "launch.nproc_per_node=2",
        "train.per_device_batch=16",
    )
    ref = tmp_path / "ref"
    p = train(ref, *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    run = tmp_path / "run"
    proc = start(run, *sets)
    wait_for(lambda: steps_logged(run) >= 5, proc=proc)
    kill9(proc)
    p = train(run, *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = final_weights(ref), final_weights(run)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.slow
def test_kills_during_checkpoint_writes_never_leave_a_partial_latest(tmp_path):
    run = tmp_path / "run"
    sets = ("train.max_steps=200", "output.save_every=1", "output.keep_last=2", "train.per_device_batch=16")
    rng = random.Random(0)
    resumed_from = []
    for _ in range(10):  # each attempt is a whole process start: 10 keep the suite under its time budget
        before = checkpoint.latest(run)
        before = (
            None if before is None else checkpoint.load_state(before).step
        )  # the folder may be rotated away
        t0 = time.time()
        proc = start(run, *sets, GPUFLEET_TEST_SLOW_SAVE="0.15")
        root = run / "checkpoints"

        def writing(root=root, t0=t0) -> bool:  # a temporary checkpoint folder created by this attempt
            try:
                return root.is_dir() and any(
                    d.name.startswith(".tmp-") and d.stat().st_mtime >= t0 for d in root.iterdir()
                )
            except FileNotFoundError:  # renamed into place between the listing and its stat: written
                return True

        # Land the kill in or after the first checkpoint write: wait for a temporary folder, then a random moment.
        wait_for(writing, proc=proc)
        time.sleep(rng.uniform(0.0, 1.0))  # the first write takes ~0.4 s: some kills land in it, some after
        kill9(proc)
        latest = checkpoint.latest(run)
        if latest is not None:
            assert (latest / "trainer_state.json").is_file() and (latest / "optimizer.pt").is_file()
            load_file(latest / "model.safetensors")  # complete and readable
            if (root / "latest").exists():  # killed between the rename and the pointer: latest() scans
                pointer = (root / "latest").read_text().strip()
                assert (root / pointer / "trainer_state.json").is_file()
            resumed_from.append(checkpoint.load_state(latest).step)
        if before is not None:
            assert latest is not None and checkpoint.load_state(latest).step >= before
    assert resumed_from and resumed_from == sorted(resumed_from)
    p = train(run, "train.max_steps=" + str(resumed_from[-1] + 2), *sets[1:])
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resuming from {checkpoint.latest(run).parent}" in p.stdout or "resuming from" in p.stdout


@pytest.mark.slow
def test_torchrun_restart_resumes_and_matches(tmp_path):
    sets = (
        "train.max_steps=6",
        "output.save_every=2",
        "launch.nproc_per_node=2",
        "train.per_device_batch=16",
    )
    ref = tmp_path / "ref"
    assert train(ref, *sets).returncode == 0
    run = tmp_path / "run"
    p = train(run, *sets, "launch.max_restarts=1", GPUFLEET_TEST_CRASH="1:4:0")
    assert p.returncode == 0, p.stdout + p.stderr
    log0 = (run / "logs" / "rank0.log").read_text()
    assert "attempt 1" in log0 and "restart 1: resuming from" in log0 and "at step 2" in log0
    a, b = final_weights(ref), final_weights(run)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.slow  # ~20 s: keeps `make test` under 8 minutes; CI runs it with the slow tests
def test_continuity(tmp_path):
    run = tmp_path / "run"
    assert train(run, "train.max_steps=2", "output.save_every=1").returncode == 0
    p = train(run, "train.max_steps=2", "algorithm.num_generations=4")
    assert p.returncode == 2
    assert "algorithm.num_generations: 8 -> 4" in p.stderr and "output.dir" in p.stderr
    p = train(run, "train.max_steps=3", "train.log_every=2")
    assert p.returncode == 0, p.stderr
    assert "train.max_steps: 2 -> 3" in p.stdout and "train.log_every: 1 -> 2" in p.stdout
    p = train(run, "train.max_steps=3")
    assert p.returncode == 0 and "nothing to do" in p.stdout


def test_export_loads_and_generates(tmp_path):
    run = tmp_path / "run"
    assert train(run, "train.max_steps=4", "output.save_every=2").returncode == 0
    out = tmp_path / "exported"
    p = subprocess.run(
        [sys.executable, "-m", "gpufleet", "export", str(run), "--step", "2", "--to", str(out)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert not (out / "optimizer.pt").exists()
    from transformers import AutoModelForCausalLM

    from gpufleet.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = load_tokenizer(str(out))
    ids = torch.tensor([tok.encode("k:", add_special_tokens=False)])
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
    saved = load_file(run / "checkpoints" / "step-2" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in load_file(out / "model.safetensors").items())
    p = subprocess.run(
        [sys.executable, "-m", "gpufleet", "export", str(run), "--step", "3", "--to", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert (
        p.returncode == 2 and "no complete checkpoint for step 3" in p.stderr and "complete: 2, 4" in p.stderr
    )
    inside = run / "final" / "sub"  # the run's next resume would replace final/ and this with it
    p = subprocess.run(
        [sys.executable, "-m", "gpufleet", "export", str(run), "--to", str(inside)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 2 and f"is inside {run / 'final'}" in p.stderr and "--to run-model" in p.stderr, (
        p.stderr
    )
    assert not inside.exists()


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoints_load_without_pickled_code(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    torch.save({"state": Evil()}, ck / "optimizer.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        checkpoint.load_optimizer(ck)


def test_continuity_sees_one_file_written_two_ways(tmp_path, monkeypatch):
    """A relative path from a flag and the absolute one a `config --format yaml` export writes, a module
    and its file: the same files, no change; another file or function is still a breaking change."""
    import yaml

    from gpufleet.config.schema import Job

    monkeypatch.chdir(tmp_path)
    for name in ("prompts.jsonl", "other.jsonl"):
        (tmp_path / name).write_text('{"prompt": "a:"}\n')
    (tmp_path / "myrew.py").write_text(
        "def length(completions, **kw):\n    return [0.0] * len(completions)\n"
    )

    def job(data: str, reward: str) -> Job:
        return Job(data={"path": data}, reward={"functions": [reward, "repeat/letters"]})

    saved = yaml.safe_dump(job("prompts.jsonl", "myrew:length").model_dump(mode="json"))
    layout, roots = {"global_batch": 8}, [str(tmp_path)]
    same = job(str(tmp_path / "prompts.jsonl"), f"{tmp_path}/myrew.py:length")
    assert continuity.continuity(saved, layout, same, layout, roots) == ([], [])
    breaking, _ = continuity.continuity(saved, layout, job("other.jsonl", "myrew.py:other"), layout, roots)
    assert breaking == [
        "data.path: 'prompts.jsonl' -> 'other.jsonl'",
        "reward.functions: ['myrew:length', 'repeat/letters'] -> ['myrew.py:other', 'repeat/letters']",
    ]


@pytest.mark.slow  # ~20 s, two training runs: make test keeps test_continuity_sees_one_file_written_two_ways
def test_a_run_started_with_relative_flags_resumes_from_its_exported_job(tmp_path):
    """The user's path: train with --set data.path=prompts.jsonl and a reward module, export the job with
    `config --format yaml` (absolute paths, the module as its file), train the export: it resumes."""
    from helpers import run_user

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a:"}\n{"prompt": "b:"}\n')
    (tmp_path / "myrew.py").write_text(
        "def length(completions, **kw):\n    return [len(c) / 9 for c in completions]\n"
    )
    flags = ["--set", "model.path=builtin:tiny-qwen2", "--set", "data.path=prompts.jsonl"]
    flags += ["--set", "reward.functions=[myrew:length]", "--set", "train.per_device_batch=4"]
    flags += ["--set", "algorithm.num_generations=2", "--set", "rollout.max_completion_length=4"]
    flags += ["--set", "output.dir=run", "--set", "output.save_every=1"]
    (tmp_path / "job.yaml").write_text("train: {seed: 1}\n")
    p = run_user("train", "job.yaml", *flags, "--set", "train.max_steps=1", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    p = run_user("config", "job.yaml", *flags, "--set", "train.max_steps=2", "--format", "yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (tmp_path / "exported.yaml").write_text(p.stdout)
    assert f"{tmp_path}/myrew.py:length" in p.stdout and f"{tmp_path}/prompts.jsonl" in p.stdout
    p = run_user("train", "exported.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resum" in p.stdout.lower() and (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
