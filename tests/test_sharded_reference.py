"""The colocated reference under FSDP (issue 13 item 2): sharded over the policy ranks like the policy,
with the same KL and the same trajectory as one rank holding the whole reference (gloo, 2 processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_multiprocess import assert_same_weights, train


def _kl(run: Path) -> list[float]:
    return [json.loads(x)["kl"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sharded_reference_equals_one_rank(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    p = train(one, "train.per_device_batch=16", "algorithm.beta=0.1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reference: sharded" not in p.stdout
    p = train(
        two,
        "train.per_device_batch=8",
        "algorithm.beta=0.1",
        "launch.nproc_per_node=2",
        "placement.strategy=fsdp",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reference: sharded with FSDP2 over 2 policy ranks (float32)" in p.stdout
    kl_one, kl_two = _kl(one), _kl(two)
    assert kl_one[-1] > 0  # the reference really scored (the policy moved away from it)
    assert kl_two == pytest.approx(kl_one, rel=1e-4, abs=1e-7)
    assert_same_weights(one, two)
