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
from gpufleet.plan.speed import DECODE_ROWS, Shape, generation_share, split_cost
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
    # issue 35's layout: policy 0,1 FSDP, rollout 2, reference 3; the generation batch 32 kept on 2 ranks
    (split,) = [s for s in splits if "--set placement.reference=3" in s["sets"]]
    assert split["sets"] == [
        "--set train.per_device_batch=16",
        "--set placement.policy=0,1",
        "--set placement.rollout=2",
        "--set placement.reference=3",
        "--set rollout.async_steps=1",
    ]
    assert [d["roles"] for d in split["devices"]] == [
        ["policy rank 0"],
        ["policy rank 1"],
        ["rollout rank 0"],
        ["scorer: reference"],
    ]
    assert all(d["headroom"] >= 0.10 for s in splits for d in s["devices"])
    # by hand (speed.py, units of one token's forward): 4 ranks of 8 rows sampling then training + scoring,
    # against the rollout rank's 32 rows (decode costs 150 rows' worth) alongside training 16 rows on each
    # policy rank while the scorer scores both ranks' 32 rows
    before = (512 * 150 + 8 * 512) + (3 * 8 * 1024 * 1.3 + 8 * 1024)
    after = max(512 * 150 + 32 * 512, 3 * 16 * 1024 * 1.3 + 32 * 1024)
    assert split["expected_time_per_completion"] == pytest.approx(after / before, abs=1e-3)
    g = split["generation_share"]
    assert g == pytest.approx((512 * 150 + 8 * 512) / before, abs=1e-3)
    costs = [s["expected_time_per_completion"] for s in splits if s["group"] == 0]
    assert costs == sorted(costs) and [s["group"] for s in splits] == sorted(s["group"] for s in splits)
    for s in splits:
        _fed_back(tmp_path, job, "4x24GB", s)
    check = run_user(
        "check", job, "--gpus", "4x24GB", *shlex.split(split["command"]), cwd=tmp_path, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr

    table = run_user("plan", job, "--gpus", "4x24GB", cwd=tmp_path, timeout=120).stdout
    lines = table.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("rollout on its own devices")))
    i = at + 1 + 2 * splits.index(split)
    assert (
        lines[i]
        == f"  {splits.index(split) + 1}. policy 0,1 (FSDP), rollout 2, reference 3 (generation batch 32 kept): {split['command']}"
    )
    assert lines[i + 1].startswith("     -> devices 0-1: policy ") and "device 2: rollout " in lines[i + 1]
    assert "device 3: reference " in lines[i + 1] and lines[i + 1].endswith("x the time per completion")
    assert lines[at + 1 + 2 * len(splits)].startswith(
        f"  estimated from the job's shape, not measured: sampling is ~{g:.0%} of its step"
    )


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


def test_reference_and_reward_model_on_one_scorer_device(tmp_path):
    """A reward model (its config.json in the user's folder) and a reference: the split that gives both a
    scorer device of their own names them, and plans again as proposed."""
    from gpufleet.models.known import known_config

    raw = known_config("Qwen/Qwen2.5-0.5B-Instruct")
    raw.update(architectures=["Qwen2ForSequenceClassification"], id2label={"0": "LABEL_0"})
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps(raw))
    job = yaml.safe_load((EXAMPLES / "gsm8k-qwen05b.yaml").read_text())
    job["reward"] = {"model": "rm"}
    job["algorithm"]["beta"] = 0.04
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    code, out = _plan_json(tmp_path, "job.yaml", "4x16GB")
    assert code == 0
    (split,) = [s for s in out["rollout_splits"] if "--set placement.reward=3" in s["sets"]]
    assert "--set placement.reference=3" in split["sets"] and "--set placement.rollout=2" in split["sets"]
    assert split["kind"].startswith("policy 0,1 (DDP), rollout 2, reference + reward model 3")
    plan = _fed_back(tmp_path, "job.yaml", "4x16GB", split)
    assert plan["devices"][3]["roles"] == ["scorer: reference + reward model"]


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


def test_env_job_gets_a_split_that_check_accepts(tmp_path):
    """An env job's rollout rank plays whole episodes, one step ahead: agent-keys on 3x24GB is proposed
    policy 0,1 and rollout 2 with async_steps 1, which plans as proposed and passes check."""
    job = yaml.safe_load((EXAMPLES / "agent-keys.yaml").read_text())
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(job))
    _, out = _plan_json(tmp_path, "agent.yaml", "3x24GB")
    (split,) = out["rollout_splits"]
    assert "--set placement.rollout=2" in split["sets"] and "--set rollout.async_steps=1" in split["sets"]
    _fed_back(tmp_path, "agent.yaml", "3x24GB", split)
    done = run_user("check", "agent.yaml", "--gpus", "3x24GB", *shlex.split(split["command"]), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_tools_on_data_job_gets_a_split_that_check_accepts(tmp_path):
    """Tools on a data set (TRL's tools=, no env): the rollout rank plays the tool episodes one step ahead,
    so the job gets the split env jobs get, which plans as proposed and passes check."""
    from test_tools_dataset import _files, _job_file

    _files(tmp_path)
    _job_file(tmp_path)
    _, out = _plan_json(tmp_path, "job.yaml", "3x24GB")
    (split,) = out["rollout_splits"]
    assert "--set placement.rollout=2" in split["sets"] and "--set rollout.async_steps=1" in split["sets"]
    _fed_back(tmp_path, "job.yaml", "3x24GB", split)
    done = run_user("check", "job.yaml", "--gpus", "3x24GB", *shlex.split(split["command"]), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _rollout_logprob_bytes(plan: dict) -> int:
    (rank,) = [p for d in plan["devices"] for p in d["processes"] if p["role"] == "rollout rank 0"]
    return rank["detail"]["sampling_logprobs"]


def test_greedy_rollout_rank_sizes_a_logprob_pass_for_single_turn_rows_only(tmp_path):
    """With the IS correction and greedy decoding, a single-turn job's rollout rank scores its rows in a
    forward of their own (the plan sizes it); a tools-on-data job's turns record theirs or go without."""
    from test_tools_dataset import _files, _job_file

    greedy = ["--set", "placement.policy=0", "--set", "placement.rollout=1", "--set", "rollout.temperature=0"]
    _user_job(tmp_path, "quickstart.yaml")
    code, out = _plan_json(tmp_path, "quickstart.yaml", "2x24GB", *greedy)
    assert code == 0 and _rollout_logprob_bytes(out["plan"]) > 0
    _files(tmp_path)
    _job_file(tmp_path)
    code, out = _plan_json(tmp_path, "job.yaml", "2x24GB", *greedy)
    assert code == 0 and _rollout_logprob_bytes(out["plan"]) == 0


def test_split_cost_by_hand():
    """speed.py: g from the job's shape; with the same rows on each side a split hides min(g, 1 - g) of a
    step, the most overlap can give; a rollout rank serving 2 policy ranks samples their rows at once."""
    r = load_job(str(EXAMPLES / "grpo-7b-4x24gb.yaml"), [], {})
    rows, P, T = 8, 512, 512
    sample = T * max(DECODE_ROWS, rows) + rows * P
    rest = 3 * rows * (P + T) * 1.3 + rows * (P + T)  # checkpointing; the reference's forward
    g = generation_share(r.job, Shape(4, 0, 0, rows))
    assert g == pytest.approx(sample / (sample + rest))
    same_rows = split_cost(r.job, (), Shape(4, 0, 0, rows), Shape(4, 4, 0, rows))
    assert same_rows == pytest.approx(1 - min(g, 1 - g))
    shared = split_cost(r.job, (), Shape(4, 0, 0, rows), Shape(4, 2, 0, rows))
    assert shared == pytest.approx((T * DECODE_ROWS + 2 * rows * P) / (sample + rest))
