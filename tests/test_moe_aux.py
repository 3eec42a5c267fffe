"""A Mixture-of-Experts policy's router load-balancing loss, as TRL 1.16 adds it (`router_aux_loss_coef`):
the coefficient rule by hand, the gradient of a real step on a tiny Qwen2-MoE equal to the policy loss's
plus coef x Hugging Face's own aux loss, whatever the micro-batches (and ranks: the slow test), `aux_loss`
logged, and check refusing a weight for a model without a router."""

from __future__ import annotations

import json

import pytest
import torch

from gpufleet.models.info import router_aux_coef
from helpers import run_user, sets

QWEN2_MOE = {"model_type": "qwen2_moe", "output_router_logits": False, "router_aux_loss_coef": 0.001}


def test_the_coefficient_as_trl_takes_it():
    assert router_aux_coef(None, QWEN2_MOE) == 0.001  # the architecture's own
    assert router_aux_coef(0.5, QWEN2_MOE) == 0.5
    assert router_aux_coef(0.0, QWEN2_MOE) == 0.0
    assert router_aux_coef(None, {"model_type": "qwen2"}) == 0.0  # no router: off
    assert router_aux_coef(None, {"model_type": "x", "text_config": QWEN2_MOE}) == 0.001  # a VLM's text model
    assert router_aux_coef(None, {"model_type": "qwen3_moe", "output_router_logits": False}) == 0.0
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        router_aux_coef(0.01, {"model_type": "qwen2"})


def _moe_folder(path):
    """A tiny Qwen2-MoE (4 experts, 2 a token) over the built-in character tokenizer, saved as a user's
    model folder."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from gpufleet.models.builtin import BUILTIN_MODELS, char_tokenizer

    base = BUILTIN_MODELS["tiny-qwen2"]
    config = Qwen2MoeConfig(
        vocab_size=base["vocab_size"],
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
        bos_token_id=base["bos_token_id"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _job(tmp_path):
    from test_trainer import make_job

    model = _moe_folder(tmp_path / "moe")
    return make_job(tmp_path, f"model.path={model}", "train.max_grad_norm=0")


def test_the_step_adds_coef_times_the_routers_aux_loss_whatever_the_micro_batches(tmp_path):
    """One micro-batch: grad(coef) == grad(0) + coef x grad(HF's aux_loss of the whole batch), as TRL adds
    it; 3 micro-batches give the same gradient and aux_loss (the step's picks and probabilities counted over
    all of them, not per forward as TRL does). float32: MoE's grouped matmul has no float64."""
    from gpufleet.rl import trainer

    job = _job(tmp_path)
    parts = trainer.build(job)
    assert parts.router_aux == 0.001  # TRL's default: the config's own
    autocast = trainer.autocast_for(job, parts.device)
    scored = trainer.generation_step(parts, 0, autocast)

    def grads(coef, micro):
        parts.router_aux, job.train.micro_batch = coef, micro
        opt = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
        metrics = trainer.optimizer_step(parts, scored.batch, opt, autocast)
        return metrics, [q.grad.clone() for q in parts.policy.parameters()]

    plain, g0 = grads(0.0, 8)
    assert "aux_loss" not in plain
    coef = 0.5
    whole, g1 = grads(coef, 8)
    parts.policy.zero_grad(set_to_none=True)
    batch = scored.batch
    out = parts.policy(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=(batch.attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        output_router_logits=True,
    )
    out.aux_loss.backward()
    g_aux = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in parts.policy.parameters()]
    assert max(float(g.abs().max()) for g in g_aux) > 1e-6  # the router's loss moves weights: not vacuous
    for a, b, aux in zip(g1, g0, g_aux, strict=True):
        torch.testing.assert_close(a, b + coef * aux, rtol=1e-4, atol=1e-6)
    assert whole["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert whole["loss"] == pytest.approx(plain["loss"], rel=1e-6)  # gpufleet's loss: the policy's
    split, g3 = grads(coef, 3)
    for a, b in zip(g3, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert split["aux_loss"] == pytest.approx(whole["aux_loss"], rel=1e-5)


def test_check_refuses_a_router_weight_for_a_model_without_one(tmp_path):
    (tmp_path / "job.yaml").write_text(
        "model: {path: builtin:tiny-qwen2}\nalgorithm: {router_aux_loss_coef: 0.01}\n"
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "router_aux_loss_coef 0.01 is set, but the model (qwen2) is not a Mixture-of-Experts" in p.stdout
    assert "fix: remove it (or 0)" in p.stdout


@pytest.mark.slow
def test_a_moe_run_from_the_cli_logs_aux_loss(tmp_path):
    """The installed CLI, a user's MoE folder: the router's loss is on by default (the config's 0.001) and
    logged every step; 0 turns it off."""
    _moe_folder(tmp_path / "moe")
    (tmp_path / "job.yaml").write_text(
        "model: {path: moe}\nrollout: {max_completion_length: 8}\nalgorithm: {num_generations: 4}\n"
        "train: {max_steps: 2, per_device_batch: 8, log_every: 1}\n"
    )
    for name, extra in (("on", []), ("off", ["algorithm.router_aux_loss_coef=0"])):
        argv = [a for s in [f"output.dir={name}", *extra] for a in ("--set", s)]
        p = run_user("train", "job.yaml", "--gpus", "cpu", *argv, cwd=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "step" in r]
        if name == "on":
            assert len(rows) == 2 and all(r["aux_loss"] > 0 for r in rows), rows
        else:
            assert all("aux_loss" not in r for r in rows)


@pytest.mark.slow
def test_two_policy_ranks_train_a_moe_to_one_ranks_weights(tmp_path):
    """The router loss counted over the step (both ranks' rows) keeps the rank-count guarantee for a MoE
    policy: 2 processes (torchrun, gloo), 4 steps, give 1 process's weights within 1e-5."""
    from test_rollout_ranks import assert_same_run

    _moe_folder(tmp_path / "moe")
    (tmp_path / "job.yaml").write_text(
        "model: {path: moe}\nrollout: {max_completion_length: 8}\n"
        "algorithm: {num_generations: 4, router_aux_loss_coef: 0.5}\n"
        "train: {max_steps: 4, per_device_batch: 16, learning_rate: 1.0e-3, log_every: 1}\n"
        "output: {save_every: 0}\n"
    )
    one, two = tmp_path / "one", tmp_path / "two"
    p = run_user("train", "job.yaml", "--gpus", "cpu", *sets(f"output.dir={one}"), cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    two_ranks = sets(f"output.dir={two}", "launch.nproc_per_node=2", "train.per_device_batch=8")
    p = run_user("train", "job.yaml", "--gpus", "cpu", *two_ranks, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_same_run(one, two)
    rows = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    twos = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert [r["aux_loss"] for r in rows] == pytest.approx([r["aux_loss"] for r in twos], rel=1e-5)
