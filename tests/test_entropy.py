"""The high-entropy token mask and the (adaptive) entropy bonus: hand values, and micro-batch invariance of
the whole optimizer step on a real tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from gpufleet.rl.entropy import EntropyControl, entropy_threshold, high_entropy_mask


def test_threshold_is_the_quantile_from_the_top():
    # values 1..5: top 40% -> quantile 0.6 of [1, 2, 3, 4, 5] = 1 + 0.6 * 4 = 3.4 -> tokens 4 and 5 trained
    values = torch.tensor([3.0, 1.0, 5.0, 2.0, 4.0])
    assert entropy_threshold(values, 0.4) == pytest.approx(3.4)
    assert entropy_threshold(values, 0.0) == pytest.approx(5.0)  # only the highest
    assert entropy_threshold(values, 1.0) == pytest.approx(1.0)  # every token
    assert entropy_threshold(torch.tensor([]), 0.2) == math.inf


def test_mask_keeps_valid_tokens_at_or_above_the_threshold():
    entropy = torch.tensor([[4.0, 1.0, 9.0], [3.4, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = high_entropy_mask(entropy, mask, 3.4)
    assert out.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]  # 9.0 is padding: never trained


def test_adaptive_controller_steps_and_gates():
    c = EntropyControl(coef=0.1, adaptive=True, target=2.0, coef_min=0.0, coef_max=0.12, delta=0.015)
    assert c.enabled and c.applied() == 0.0  # no measurement yet (inf > target): no bonus, as TRL
    c.update(1.5)  # at or below the target: up, capped at coef_max
    assert c.coef == pytest.approx(0.115) and c.applied() == pytest.approx(0.115)
    c.update(1.0)
    assert c.coef == pytest.approx(0.12)
    c.update(3.0)  # above: down, and no bonus next step
    assert c.coef == pytest.approx(0.105) and c.applied() == 0.0
    state = c.state_dict()
    d = EntropyControl(adaptive=True)
    d.load_state_dict(state)
    assert (d.coef, d.last_entropy) == (c.coef, 3.0)


def test_static_coefficient_is_constant():
    c = EntropyControl(coef=0.05)
    c.update(0.0)
    assert c.applied() == 0.05 and c.coef == 0.05 and c.enabled
    assert not EntropyControl().enabled


def test_entropy_options_do_not_depend_on_micro_batch(tmp_path):
    sets = ("algorithm.entropy_coef=0.05", "algorithm.top_entropy_quantile=0.5")
    from gpufleet.config.load import load_job
    from gpufleet.rl import trainer

    base = [
        "rollout.max_prompt_length=8",
        "rollout.max_completion_length=8",
        "algorithm.num_generations=4",
        "algorithm.loss_type=dapo",
        "train.per_device_batch=8",
        "train.max_grad_norm=0",
        f"output.dir={tmp_path}/run",
    ]
    job = load_job(None, [*base, *sets], env={}).job
    parts = trainer.build(job)
    parts.policy.double()
    autocast = trainer.autocast_for(job, parts.device)
    scored = trainer.generation_step(parts, 0, autocast)
    grads, metrics = [], []
    for micro in (8, 3):
        job.train.micro_batch = micro
        opt = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
        metrics.append(trainer.optimizer_step(parts, scored.batch, opt, autocast))
        grads.append([q.grad.clone() for q in parts.policy.parameters() if q.grad is not None])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)
    assert metrics[0]["loss"] < metrics[0]["policy_loss"]  # the bonus is subtracted


def test_check_refuses_adaptive_bounds_that_cross(tmp_path):
    from helpers import run_user, sets

    (tmp_path / "job.yaml").write_text("model: {path: builtin:tiny-qwen2}\n")
    bad = sets(
        "algorithm.use_adaptive_entropy=true",
        "algorithm.entropy_coef_min=0.5",
        "algorithm.entropy_coef_max=0.1",
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", *bad, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "entropy_coef_min 0.5 > entropy_coef_max 0.1" in p.stdout
    assert "fix: --set algorithm.entropy_coef_max=0.5" in p.stdout
    p = run_user("check", "job.yaml", "--gpus", "cpu", *bad[:4], cwd=tmp_path)  # min 0.5 <= max 1.0
    assert p.returncode == 0, p.stdout + p.stderr
