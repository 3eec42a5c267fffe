"""TRL 1.16's reward keywords: `trainer_state` (a curriculum on global_step), `log_metric` and `log_extra`,
through the installed command on 1 and 2 ranks (tests/test_rewards_signature.py has the signatures)."""

from __future__ import annotations

import json

import pytest

from helpers import run_user

REWARDS = """\
def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
    step = trainer_state.global_step
    log_metric("curriculum/level", float(step))
    log_metric("curriculum/longest", float(max(len(c) for c in completions)))
    log_extra("level", [step] * len(completions))
    return [float(step) + len(c) / 100 for c in completions]


def plain(completions, **kwargs):  # a TRL reward that reads nothing of this: it still gets them
    assert kwargs["trainer_state"].max_steps == 3
    return [0.0] * len(completions)
"""

JOB = """\
model: {path: "builtin:tiny-qwen2"}
data: {path: prompts.jsonl}
reward: {functions: ["my_rewards:curriculum", "my_rewards:plain"]}
algorithm: {num_generations: 2}
rollout: {max_prompt_length: 8, max_completion_length: 4}
train: {per_device_batch: 4, max_steps: 3, samples_every: 1}
output: {dir: run}
"""


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_trainer_state_log_metric_and_log_extra(tmp_path, ranks):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{c}:"}) + "\n" for c in "abcd"))
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    flags = ["--set", f"launch.nproc_per_node={ranks}"] if ranks > 1 else []
    p = run_user("train", "job.yaml", "--gpus", "cpu", *flags, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["curriculum/level"] for m in metrics] == [0.0, 1.0, 2.0]  # optimizer steps done, as TRL's
    assert all(0 <= m["rewards/curriculum/mean"] - (m["step"] - 1) <= 0.04 for m in metrics)
    assert all(1.0 <= m["curriculum/longest"] <= 4.0 for m in metrics)
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["extra"] == {"level": s["step"] - 1} for s in samples)
