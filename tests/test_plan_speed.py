"""plan/speed.py: the expected time per completion of a fix, against hand-computed products."""

from __future__ import annotations

import math

import pytest

from gpufleet.config.load import load_job
from gpufleet.plan.change import Change
from gpufleet.plan.speed import step_cost


def _job(*sets: str):
    return load_job(None, ["train.per_device_batch=16", "train.micro_batch=8", *sets], env={}).job


def test_step_cost_multiplies_the_factors():
    job = _job()
    assert step_cost(job, (), 4, 4) == 1.0
    assert step_cost(job, (Change("model.gradient_checkpointing", True),), 4, 4) == pytest.approx(1.3)
    assert step_cost(job, (Change("train.micro_batch", 2),), 4, 4) == pytest.approx(1.1)  # 2 halvings
    full = (
        Change("placement.strategy", "fsdp"),
        Change("placement.offload", "params"),
        Change("train.precision", "bf16"),
    )
    assert step_cost(job, full, 4, 4) == pytest.approx(1.15 * 1.5 * 0.5)
    lora = (Change("model.use_peft", True), Change("train.precision", "bf16"))
    assert step_cost(job, lora, 4, 4) == pytest.approx(0.75 * 0.5)
    assert step_cost(job, (Change("placement.reference", [3]),), 4, 3) == pytest.approx(4 / 3)
    assert step_cost(job, (Change("placement.strategy", "fsdp"),), 4, 10) == pytest.approx(0.4 * 1.15)


def test_what_the_job_already_does_costs_nothing():
    job = _job("placement.strategy=fsdp", "placement.offload=params", "model.gradient_checkpointing=true")
    same = (Change("placement.strategy", "fsdp"), Change("model.gradient_checkpointing", True))
    assert step_cost(job, same, 2, 2) == 1.0
    assert step_cost(job, (Change("train.micro_batch", 1),), 2, 2) == pytest.approx(1 + 0.05 * math.log2(8))
