"""`gpufleet plan` proposes rollout/training splits (plan/split.py): rollout on devices of its own, one step
ahead, each layout planned. Run through the installed CLI from a user's folder; every proposal's flags are
fed back to `gpufleet plan` (it fits, with a rollout row, the same per-device totals) and to `gpufleet check`."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from gpufleet.config.load import load_job
from gpufleet.plan.speed import DECODE_ROWS, async_overlap, generation_share
from helpers import run_user

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _user_job(tmp_path: Path, name: str) -> str:
    shutil.copy(EXAMPLES / name, tmp_path / name)
    return name


def _plan_json(tmp_path: Path, job: str, gpus: str, *flags: str) -> tuple[int, dict]:
    done = run_user("plan", job, "--gpus", gpus, "--format", "json", *flags, cwd=tmp_path, timeout=120)
    assert done.stderr == "", done.stderr
    return done.returncode, json.loads(done.stdout)


def _fed_back(tmp_path: Path, job: str, gpus: str, split: dict) -> dict:
    """Plan the job again with the split's flags: it fits comfortably with rollout ranks, as proposed."""
    flags = shlex.split(split["command"])
    assert all(f == "--set" or "=" in f for f in flags), flags
    code, out = _plan_json(tmp_path, job, gpus, *flags)
    plan = out["plan"]
    assert code == 0 and plan["comfortable"], (split["command"], out["problems"])
    roles = {d["device"]: d["roles"] for d in plan["devices"]}
    assert any(r.startswith("rollout rank") for rs in roles.values() for r in rs), roles
    assert roles == {d["device"]: d["roles"] for d in split["devices"]}
    assert [d["total_bytes"] for d in plan["devices"]] == [d["total_bytes"] for d in split["devices"]]
    assert out["rollout_splits"] == []  # the job is split now: nothing more to propose
    return plan


def test_7b_on_4x24gb_proposes_the_split_and_its_flags_fit(tmp_path):
    job = _user_job(tmp_path, "grpo-7b-4x24gb.yaml")
    code, out = _plan_json(tmp_path, job, "4x24GB")
    assert code == 0
    splits = out["rollout_splits"]
    assert 1 <= len(splits) <= 3
    first = splits[0]  # the same training first: the generation batch 32 kept on 2 policy ranks
    assert first["sets"] == [
        "--set train.per_device_batch=16",
        "--set placement.policy=0,1",
        "--set placement.rollout=2",
        "--set placement.reference=3",
        "--set rollout.async_steps=1",
    ]
    assert [d["roles"] for d in first["devices"]] == [
        ["policy rank 0"],
        ["policy rank 1"],
        ["rollout rank 0"],
        ["scorer: reference"],
    ]
    assert all(d["headroom"] >= 0.10 for s in splits for d in s["devices"])
    g = first["generation_share"]
    assert 0.5 < g < 0.8  # 512 decode steps at 8 rows against 3 passes (+ checkpointing) and a reference
    # 2 policy ranks where there were 4, half the step hidden at best: 2 x (1 - min(g, 1 - g))
    assert first["expected_time_per_completion"] == pytest.approx(2 * (1 - min(g, 1 - g)), abs=1e-3)
    costs = [s["expected_time_per_completion"] for s in splits if s["group"] == 0]
    assert costs == sorted(costs)
    for s in splits:
        _fed_back(tmp_path, job, "4x24GB", s)
    check = run_user(
        "check", job, "--gpus", "4x24GB", *shlex.split(first["command"]), cwd=tmp_path, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr

    table = run_user("plan", job, "--gpus", "4x24GB", cwd=tmp_path, timeout=120).stdout
    lines = table.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("rollout on its own devices")))
    assert (
        lines[at + 1]
        == f"  1. policy 0,1 (FSDP), rollout 2, reference 3 (generation batch 32 kept): {first['command']}"
    )
    assert lines[at + 2].startswith("     -> devices 0-1: policy ") and "device 2: rollout " in lines[at + 2]
    assert "device 3: reference " in lines[at + 2] and lines[at + 2].endswith("x the time per completion")
    assert lines[at + 1 + 2 * len(splits)].startswith(f"  estimated: sampling is ~{g:.0%} of this job's step")


def test_quickstart_on_3x24gb_one_split_that_fits(tmp_path):
    job = _user_job(tmp_path, "quickstart.yaml")
    code, out = _plan_json(tmp_path, job, "3x24GB")
    assert code == 0
    (split,) = out["rollout_splits"]  # no scorer (beta 0): policy 0,1 and rollout 2 is the only layout
    assert split["sets"] == [
        "--set train.per_device_batch=192",  # 384 completions per step, as on 3 policy ranks
        "--set placement.policy=0,1",
        "--set placement.rollout=2",
        "--set rollout.async_steps=1",
    ]
    plan = _fed_back(tmp_path, job, "3x24GB", split)
    assert plan["per_device_batch"] * 2 == 384
    table = run_user("plan", job, "--gpus", "3x24GB", cwd=tmp_path, timeout=120).stdout
    assert "  1. policy 0,1 (DDP), rollout 2 (generation batch 384 kept): " + split["command"] in table


def test_no_split_when_it_cannot_help(tmp_path):
    """One device; a 7B whose policy needs both GPUs (offload needs FSDP over 2+ ranks); a job already
    split; the CPU."""
    quick = _user_job(tmp_path, "quickstart.yaml")
    big = _user_job(tmp_path, "grpo-7b-4x24gb.yaml")
    for job, gpus, flags in (
        (quick, "1x24GB", ()),
        (big, "2x80GB", ()),
        (quick, "3x24GB", ("--set", "placement.rollout=2")),
        (quick, "cpu", ()),
    ):
        _, out = _plan_json(tmp_path, job, gpus, *flags)
        assert out["plan"] is not None and out["rollout_splits"] == [], (job, gpus)
    table = run_user("plan", big, "--gpus", "2x80GB", cwd=tmp_path, timeout=120).stdout
    assert table.startswith("gpufleet plan") and "rollout on its own devices" not in table


def test_env_job_gets_no_split(tmp_path):
    """An env job's turns cannot be sampled ahead (check refuses async_steps with an env)."""
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text()))
    )
    _, plain = _plan_json(tmp_path, "job.yaml", "3x24GB")
    assert plain["rollout_splits"]
    job = yaml.safe_load((EXAMPLES / "agent-keys.yaml").read_text())
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(job))
    _, out = _plan_json(tmp_path, "agent.yaml", "3x24GB")
    assert out["plan"] is not None and out["rollout_splits"] == []


def test_generation_share_by_hand(tmp_path):
    """g from the job's shape (speed.py): sampling T x max(DECODE_ROWS, rows) + rows x P against training
    3 x rows x (P + T) (x1.3 checkpointing) and one forward per scoring model."""
    r = load_job(str(EXAMPLES / "grpo-7b-4x24gb.yaml"), [], {})
    rows, P, T = 8, 512, 512
    sample = T * max(DECODE_ROWS, rows) + rows * P
    train = 3 * rows * (P + T) * 1.3 + rows * (P + T)  # checkpointing; the reference's forward
    assert generation_share(r.job) == pytest.approx(sample / (sample + train))
    assert async_overlap(0.7) == pytest.approx(0.7) and async_overlap(0.2) == pytest.approx(0.8)
    assert async_overlap(0.5) == pytest.approx(0.5)
