"""The colocated reference and reward model under FSDP (issue 13 item 2): sharded over the policy ranks
like the policy, with the same KL, rewards and trajectory as one rank holding the whole models (gloo,
2 processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_multiprocess import assert_same_weights, train


def _metric(run: Path, key: str) -> list[float]:
    return [json.loads(x)[key] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _kl(run: Path) -> list[float]:
    return _metric(run, "kl")


@pytest.mark.slow
def test_sharded_reference_equals_one_rank(tmp_path):
    from mp_rewards import tiny_reward_model

    rm = tiny_reward_model(tmp_path / "rm")
    one, two = tmp_path / "one", tmp_path / "two"
    scored = (f"reward.model={rm}", "reward.weights=1,1,0.5")
    p = train(one, "train.per_device_batch=16", "algorithm.beta=0.1", *scored)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reference: sharded" not in p.stdout
    p = train(
        two,
        "train.per_device_batch=8",
        "algorithm.beta=0.1",
        "launch.nproc_per_node=2",
        "placement.strategy=fsdp",
        *scored,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reference: sharded with FSDP2 over 2 policy ranks (float32)" in p.stdout
    assert "reward model: sharded with FSDP2 over 2 policy ranks (float32)" in p.stdout
    rm_one, rm_two = _metric(one, "rewards/reward_model/mean"), _metric(two, "rewards/reward_model/mean")
    assert rm_two == pytest.approx(rm_one, rel=1e-4, abs=1e-6)
    kl_one, kl_two = _kl(one), _kl(two)
    assert kl_one[-1] > 0  # the reference really scored (the policy moved away from it)
    assert kl_two == pytest.approx(kl_one, rel=1e-4, abs=1e-7)
    assert_same_weights(one, two)
