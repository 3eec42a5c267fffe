"""The trainer on real tiny models: micro-batch invariance, batch reuse, bad rewards, saving."""

from __future__ import annotations

import json

import pytest
import torch

from gpufleet.config.load import load_job
from gpufleet.errors import UserError
from gpufleet.rl import trainer
from gpufleet.rl.batch import logprobs_of


def make_job(tmp_path, *sets):
    r = load_job(
        None,
        [
            "data.path=builtin:repeat",
            "rollout.max_prompt_length=8",
            "rollout.max_completion_length=8",
            "algorithm.num_generations=4",
            "train.per_device_batch=8",
            f"output.dir={tmp_path}/run",
            *sets,
        ],
        env={},
    )
    assert not r.problems, [p.render() for p in r.problems]
    return r.job


def grads_for(job, scored, parts, micro):
    job.train.micro_batch = micro
    opt = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    trainer.optimizer_step(parts, scored.batch, opt, trainer.autocast_for(job, parts.device))
    return [q.grad.clone() for q in parts.policy.parameters() if q.grad is not None]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_does_not_depend_on_micro_batch(tmp_path, loss_type):
    job = make_job(tmp_path, f"algorithm.loss_type={loss_type}", "algorithm.beta=0.1")
    parts = trainer.build(job)
    parts.policy.double()
    parts.reference.double()
    scored = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    # Ratios != 1 and a real KL term: perturb the old log-probs of the batch.
    scored.batch.old_logprobs = torch.randn_like(scored.batch.ref_logprobs, dtype=torch.float64) * 0.05 - 2.0
    lens = scored.rollout.completion_lengths
    assert lens.min() != lens.max() or True
    full = grads_for(job, scored, parts, 8)
    for micro in (4, 2, 1):
        other = grads_for(job, scored, parts, micro)
        for a, b in zip(full, other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_reused_batch_keeps_generating_logprobs(tmp_path):
    job = make_job(
        tmp_path, "train.steps_per_generation=2", "train.per_device_batch=4", "algorithm.num_iterations=2"
    )
    parts = trainer.build(job)
    scored = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    assert (
        scored.batch.old_logprobs is not None
        and scored.batch.old_logprobs.shape == scored.batch.completion_mask.shape
    )
    assert scored.batch.input_ids.shape[0] == 8  # 4 per step x 2 steps per generation
    # The old log-probs are those of the sampled distribution: pad (not EOS here) left out, as in sampling.
    with torch.no_grad():
        free = logprobs_of(parts.train_model, scored.batch, 1.0, 8, trainer.autocast_for(job, parts.device))
    valid = scored.batch.completion_mask.bool()
    assert parts.suppress_tokens == (0,)
    assert (scored.batch.old_logprobs[valid] > free[valid]).all()  # renormalised without pad's share


def test_train_writes_metrics_samples_and_model(tmp_path):
    job = make_job(
        tmp_path,
        "train.max_steps=3",
        "train.samples_every=1",
        "train.learning_rate=1e-3",
        "reward.functions=repeat/chars,test_trainer:length_reward",
    )
    out = tmp_path / "run"
    lines = []
    last = trainer.train(job, out, log=lines.append)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in (
        "reward",
        "reward_std",
        "rewards/repeat_chars/mean",
        "rewards/length_reward/mean",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "loss",
        "grad_norm",
        "learning_rate",
        "step_time",
        "tokens_per_s",
    ):
        assert key in records[0], key
    assert len(lines) == 3 and lines[-1].startswith("step 3/3")
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "reward"} <= set(samples[0])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    trained = dict(model.named_parameters())
    parts = trainer.build(job)
    # The built-in <pad> (0) is not EOS: never sampled nor scored, and the saved model says so to generate.
    assert parts.suppress_tokens == (0,) and model.generation_config.suppress_tokens == [0]
    initial = dict(parts.policy.named_parameters())
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # it learned something
    assert last["step"] == 3


def test_rollout_runs_without_the_gradients(tmp_path, monkeypatch):
    """The gradients are freed after each optimizer step, so every rollout after the first runs without
    them (plan/build.py counts rollout and scoring so); they are there again for the step after it."""
    job = make_job(tmp_path, "train.max_steps=3", "train.learning_rate=1e-3", "algorithm.beta=0.1")
    seen, real = [], trainer.generation_step

    def generation_step(parts, *args):
        seen.append(sum(q.grad is not None for q in parts.policy.parameters()))
        return real(parts, *args)

    steps = []
    real_step = trainer.optimizer_step

    def optimizer_step(parts, *args):
        m = real_step(parts, *args)
        steps.append(sum(q.grad is not None for q in parts.policy.parameters()))
        return m

    monkeypatch.setattr(trainer, "generation_step", generation_step)
    monkeypatch.setattr(trainer, "optimizer_step", optimizer_step)
    trainer.train(job, tmp_path / "run", log=lambda line: None)
    assert seen == [0, 0, 0]
    assert len(steps) == 3 and min(steps) > 0


def length_reward(prompts, completions, **kw):
    return [len(c) / 8 for c in completions]


def bad_reward_raises(prompts, completions, **kw):
    if any("q" in c for c in completions):
        raise KeyError("no q allowed")
    return [0.0] * len(completions)


def bad_reward_length(prompts, completions, **kw):
    return [0.0]


def bad_reward_value(prompts, completions, **kw):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize(
    "fn, text",
    [
        ("bad_reward_length", "returned 1 values for 8 completions"),
        ("bad_reward_value", "returned nan for sample 0"),
    ],
)
def test_bad_reward_functions(tmp_path, fn, text):
    job = make_job(tmp_path, f"reward.functions=test_trainer:{fn}")
    parts = trainer.build(job)
    with pytest.raises(UserError) as e:
        trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    assert text in str(e.value) and fn in str(e.value) and "Fix:" in str(e.value)


def test_reward_that_raises_names_first_sample(tmp_path):
    from gpufleet.rl.rewards import _call_checked

    with pytest.raises(UserError) as e:
        _call_checked(bad_reward_raises, "bad_reward_raises", ["a:", "b:", "c:"], ["aa", "bq", "cq"], {})
    assert "sample 1" in str(e.value) and "'bq'" in str(e.value) and "KeyError" in str(e.value)


def test_dataset_without_prompt_field(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"question": "x"}\n')
    job = make_job(tmp_path, f"data.path={tmp_path}/d.jsonl", "reward.functions=repeat/chars")
    with pytest.raises(UserError) as e:
        trainer.build(job)
    assert "data.prompt_field" in str(e.value) and "question" in str(e.value)


def test_local_dataset_columns_reach_rewards(tmp_path):
    rows = [{"prompt": f"{c}:", "target": c * 8} for c in "abcd"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    job = make_job(tmp_path, f"data.path={tmp_path}/d.jsonl", "reward.functions=repeat/chars")
    parts = trainer.build(job)
    scored = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    assert len(scored.completions) == 8 and scored.prompts[0].endswith(":")


def test_min_completion_length_in_sampling_every_logprob_and_the_saved_model(tmp_path):
    """rollout.min_completion_length: EOS has probability 0 before it in the old and reference log-probs
    as in sampling (the training log-probs: tests/test_rollout.py), and the saved model's generate knows."""
    job = make_job(
        tmp_path,
        "rollout.min_completion_length=5",
        "algorithm.beta=0.1",
        "algorithm.num_iterations=2",
        "train.max_steps=1",
    )
    parts = trainer.build(job)
    scored = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    lengths = scored.rollout.completion_lengths
    assert ((lengths >= 6) | scored.rollout.is_truncated).all()
    with torch.no_grad():
        free = logprobs_of(
            parts.train_model, scored.batch, 1.0, 8, trainer.autocast_for(job, parts.device), (0,)
        )
    for logp in (scored.batch.old_logprobs, scored.batch.ref_logprobs):
        assert (logp[:, :5] > free[:, :5]).all()  # renormalised without EOS's share
        torch.testing.assert_close(logp[:, 5:], free[:, 5:], rtol=0, atol=1e-6)
    trainer.train(job, tmp_path / "run", log=lambda _: None)
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(tmp_path / "run" / "final").min_new_tokens == 5
