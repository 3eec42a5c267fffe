"""End to end through the CLI: the reward rises on the built-in task, and failures are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpufleet.cli import main
from gpufleet.rl.optim import lr_factor
from helpers import run_process

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def train_here(run: Path, *sets: str) -> int:
    """`gpufleet train examples/quickstart.yaml --gpus cpu --set output.dir=RUN --set ...` in-process."""
    return main(
        [
            "train",
            QUICK,
            "--gpus",
            "cpu",
            "--set",
            f"output.dir={run}",
            *(x for s in sets for x in ("--set", s)),
        ],
        env={},
    )


def test_reward_rises_on_builtin_task(tmp_path, capsys):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    code = train_here(run, "train.max_steps=90", "train.log_every=30")
    out = capsys.readouterr().out
    assert code == 0, out
    rewards = [m["reward"] for m in read_metrics(run)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.1
    assert last > first + 0.1, (first, last)
    assert "model:" in out and str(run / "final") in out
    # A second `train` on a finished run does nothing and loses nothing.
    before = (run / "metrics.jsonl").read_text()
    assert train_here(run, "train.max_steps=90") == 0
    assert "already holds a finished run" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("precision, checkpointing", [("bf16", False), ("fp32", True)])
def test_precision_and_checkpointing_run(tmp_path, capsys, precision, checkpointing):
    run = tmp_path / "run"
    code = train_here(
        run,
        "train.max_steps=2",
        "train.per_device_batch=16",
        f"train.precision={precision}",
        f"model.gradient_checkpointing={str(checkpointing).lower()}",
    )
    assert code == 0, capsys.readouterr()
    assert all(m["grad_norm"] >= 0 for m in read_metrics(run))


def test_bad_job_starts_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    code = train_here(run, "algorithm.num_generations=5")
    err = capsys.readouterr().err
    assert code == 2 and "algorithm.num_generations" in err and "Nothing was started" in err
    assert not run.exists()


def test_reward_error_is_one_line_and_keeps_old_outputs(tmp_path):
    (tmp_path / "badreward.py").write_text(
        "def score(prompts, completions, **kw):\n    return [1.0 / (len(c) - len(c)) for c in completions]\n"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    p = run_process(
        "train",
        QUICK,
        "--gpus",
        "cpu",
        "--set",
        f"output.dir={run}",
        "--set",
        "reward.functions=badreward:score",
        "--set",
        "reward.weights=null",
        "--set",
        "train.max_steps=2",
        cwd=tmp_path,
        env_extra={"PYTHONPATH": str(tmp_path)},
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    line = [x for x in p.stderr.splitlines() if x.startswith("gpufleet: error")]
    assert len(line) == 1 and "score raised ZeroDivisionError" in line[0] and "sample 0" in line[0]
    assert f"division by zero at {tmp_path / 'badreward.py'}:2 on sample 0" in line[0], line[0]
    assert (run / "notes.txt").read_text() == "keep me"


def test_lr_schedules():
    assert [lr_factor(s, warmup=2, total=10, kind="constant") for s in (0, 1, 5)] == [0.0, 0.5, 1.0]
    assert lr_factor(2, warmup=2, total=10, kind="linear") == 1.0
    assert lr_factor(6, warmup=2, total=10, kind="linear") == 0.5
    assert lr_factor(6, warmup=2, total=10, kind="cosine") == pytest.approx(0.5)
    assert lr_factor(10, warmup=2, total=10, kind="cosine") == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kind, hf", [("constant", "constant_with_warmup"), ("linear", "linear"), ("cosine", "cosine")]
)
def test_lr_schedules_equal_the_ones_trl_runs(kind, hf):
    """Every step's learning rate equals transformers' scheduler of the same name (TRL's lr_scheduler_type),
    warm-up included (0 at step 0)."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(hf, opt, num_warmup_steps=3, num_training_steps=10)
    theirs = []
    for _ in range(11):  # steps 0..10 (a run of max_steps 10 takes steps 0..9)
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [lr_factor(s, warmup=3, total=10, kind=kind) for s in range(11)]
    assert ours == pytest.approx(theirs, abs=1e-12)


def test_adam_settings_reach_the_optimizer_and_bad_ones_are_refused(tmp_path):
    """train.adam_beta1 / adam_beta2 / adam_epsilon (TRL's names) set AdamW's; a beta of 1 is one line, exit 2."""
    from gpufleet.config.schema import TrainSection
    from gpufleet.rl.optim import build_optimizer

    train = TrainSection(adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, learning_rate=0.1)
    opt, _ = build_optimizer([torch.nn.Parameter(torch.ones(3))], train)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["eps"] == 1e-6
    (tmp_path / "job.yaml").write_text("model: {path: builtin:tiny-qwen2}\ntrain: {adam_beta2: 1.0}\n")
    p = run_process("check", str(tmp_path / "job.yaml"), cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "train.adam_beta2" in p.stdout + p.stderr


def test_non_finite_loss_stops_cleanly_and_keeps_checkpoints(tmp_path):
    run = tmp_path / "run"
    p = run_process(
        "train",
        QUICK,
        "--gpus",
        "cpu",
        "--set",
        f"output.dir={run}",
        "--set",
        "train.learning_rate=1e30",
        "--set",
        "train.max_steps=6",
        "--set",
        "output.save_every=1",
        "--set",
        "train.per_device_batch=16",
        "--set",
        "reward.functions=repeat/chars,mp_rewards:length",
        "--set",
        "reward.weights=null",
        cwd=tmp_path,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    assert "non-finite" in p.stderr and "train.learning_rate" in p.stderr
    from gpufleet import checkpoint

    latest = checkpoint.latest(run)
    assert latest is not None and (latest / "model.safetensors").is_file()
