"""LoRA through peft (model.use_peft): adapter counts equal to peft's, planned memory equal to measured,
the reference is the base model (no copy), checkpoints hold the adapter and resume exactly, 2 ranks give
the weights of 1, export writes the adapter and (--merge) one model with the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpufleet.config.schema import ModelSection, TrainSection
from gpufleet.models import load_causal_lm, resolve_model_path
from gpufleet.models.lora import apply, trainable_parameters
from helpers import kill9_after_steps, process_env, run_cli, run_user

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")
LORA = ("model.use_peft=true", "model.lora_target_modules=all-linear", "train.learning_rate=0.01")


@pytest.mark.parametrize("model", ["builtin:tiny-qwen2", "builtin:tiny-llama", "builtin:small-qwen2"])
@pytest.mark.parametrize(
    "targets",
    [None, ["all-linear"], ["q_proj", "k_proj", "o_proj", "down_proj"], ["q_proj", "v_proj", "lm_head"]],
)
def test_adapter_count_equals_peft(model, targets):
    section = ModelSection(use_peft=True, lora_target_modules=targets, lora_r=8)
    config = json.loads((Path(resolve_model_path(model)) / "config.json").read_text())
    peft_model = apply(load_causal_lm(model), section)
    trainable, _ = peft_model.get_nb_trainable_parameters()  # what print_trainable_parameters prints
    assert trainable_parameters(config, section) == trainable


def test_planned_grads_and_optimizer_are_the_adapters_measured():
    from gpufleet.engine.logprobs import sequence_logprobs
    from gpufleet.plan.memory import Precision, train_state_bytes
    from gpufleet.plan.shape import arch_from_config, count_parameters
    from gpufleet.rl.optim import build_optimizer

    section = ModelSection(use_peft=True, lora_target_modules=["all-linear"])
    model = apply(load_causal_lm("builtin:tiny-qwen2"), section).train()
    ids = torch.randint(2, 80, (3, 16), generator=torch.Generator().manual_seed(0))
    opt, _ = build_optimizer(model.parameters(), TrainSection())
    logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 8)
    logp.sum().backward()
    opt.step()
    trained = [q for q in model.parameters() if q.requires_grad]
    measured = {
        "weights": sum(q.numel() * 4 for q in model.parameters()),
        "grads": sum(q.grad.numel() * 4 for q in trained),
        "optimizer": sum(t.numel() * 4 for s in opt.state.values() for t in s.values() if t.dim() > 0),
    }
    config = model.base_model.model.config.to_dict()
    predicted = train_state_bytes(
        count_parameters(arch_from_config(config)),
        Precision("float32", "float32"),
        adapter=trainable_parameters(config, section),
    )
    for key, value in measured.items():
        assert abs(predicted[key] / value - 1) <= 0.01, (key, value, predicted[key])


def test_the_reference_is_the_base_model_with_the_adapter_off(tmp_path):
    """beta > 0 with LoRA: no reference model is loaded; its log-probs are the base model's."""
    from gpufleet.config.presets import PRESETS
    from gpufleet.config.schema import Job
    from gpufleet.rl.batch import logprobs_of
    from gpufleet.rl.parts import build
    from gpufleet.rl.precision import autocast_for
    from gpufleet.rl.step import generation_step

    job = Job.model_validate(
        {
            "model": {"use_peft": True, "lora_target_modules": ["all-linear"]},
            "algorithm": {"beta": 0.04, "num_generations": 4, **PRESETS["grpo"]},
            "rollout": {"max_prompt_length": 8, "max_completion_length": 8},
            "train": {"per_device_batch": 8},
            "output": {"dir": str(tmp_path)},
        }
    )
    assert job.roles_used()["reference"] is False
    p = build(job)
    assert p.reference is None
    with torch.no_grad():  # a trained adapter: B away from its zero init
        for name, q in p.policy.named_parameters():
            if "lora_B" in name:
                q.normal_(0, 0.5)
    scored = generation_step(p, 0, autocast_for(job, p.device))
    base = load_causal_lm(job.model.path)
    expected = logprobs_of(base, scored.batch, 1.0, 8, autocast_for(job, p.device), p.suppress_tokens)
    mask = scored.batch.completion_mask.bool()
    assert torch.allclose(scored.batch.ref_logprobs[mask], expected[mask], atol=1e-5)
    policy = logprobs_of(p.policy, scored.batch, 1.0, 8, autocast_for(job, p.device))
    assert (policy[mask] - expected[mask]).abs().max() > 1e-3  # the adapter does change the policy


def train(run: Path, *sets: str, timeout=300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "gpufleet", "train", QUICK, "--gpus", "cpu", "--set", f"output.dir={run}"]
    for s in (*LORA, "train.per_device_batch=32", "train.log_every=1", *sets):
        argv += ["--set", s]
    return subprocess.run(argv, capture_output=True, text=True, env=process_env(), cwd=ROOT, timeout=timeout)


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_two_ranks_equal_one_rank_and_checkpoints_hold_the_adapter(tmp_path, strategy):
    # lora_dropout 0: dropout masks come from each rank's own random stream (as in any DDP run).
    # fsdp: the adapter's base layers are found under peft's wrapper (it used to stop every rank)
    sets = ("train.max_steps=3", "algorithm.beta=0.04", "output.save_every=2", "model.lora_dropout=0")
    one, two = tmp_path / "one", tmp_path / "two"
    p = train(one, *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "adapter:" in p.stdout and "--merge" in p.stdout
    p = train(
        two, *sets, "train.per_device_batch=16", "launch.nproc_per_node=2", f"placement.strategy={strategy}"
    )
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = adapter(one / "final"), adapter(two / "final")
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    ckpt = one / "checkpoints" / "step-2"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()


@pytest.mark.slow
def test_lora_kill9_then_resume_is_bitwise_identical(tmp_path):
    sets = ("train.max_steps=8", "output.save_every=3")
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *sets).returncode == 0
    argv = [sys.executable, "-m", "gpufleet", "train", QUICK, "--gpus", "cpu", "--set", f"output.dir={run}"]
    for s in (*LORA, "train.per_device_batch=32", "train.log_every=1", *sets):
        argv += ["--set", s]
    kill9_after_steps(argv, run, 5, cwd=ROOT, log=tmp_path / "killed.log", timeout=120)
    p = train(run, *sets)
    assert p.returncode == 0 and "resuming from" in p.stdout, p.stdout + p.stderr
    a, b = adapter(ref / "final"), adapter(run / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "targets", ["all-linear", pytest.param("q_proj,v_proj,lm_head", marks=pytest.mark.slow)]
)
def test_export_writes_the_adapter_and_merge_writes_one_model_with_the_same_logits(tmp_path, capsys, targets):
    """With an adapter on the (tied) output head the merged model gets its own head: the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    p = train(run, "train.max_steps=2", f"model.lora_target_modules={targets}")
    assert p.returncode == 0, p.stdout + p.stderr
    code, out = run_cli(capsys, ["export", str(run), "--to", str(tmp_path / "adapter")])
    assert code == 0 and "PeftModel.from_pretrained" in out, out
    merge = run_user("export", str(run), "--to", str(tmp_path / "merged"), "--merge", cwd=tmp_path)
    assert merge.returncode == 0, merge.stdout + merge.stderr
    assert "Warning" not in merge.stderr, merge.stderr  # peft x transformers deprecation noise
    ids = torch.tensor([[5, 6, 7, 8]])
    peft_model = PeftModel.from_pretrained(load_causal_lm("builtin:tiny-qwen2"), str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.allclose(peft_model(ids).logits, merged(ids).logits, atol=1e-5)
    code, out = run_cli(capsys, ["export", str(tmp_path / "nothing"), "--to", str(tmp_path / "x"), "--merge"])
    assert code == 2 and "Traceback" not in out


def test_check_refuses_lora_targets_that_do_not_exist(capsys):
    code, out = run_cli(
        capsys, ["check", QUICK, "--gpus", "cpu", "--set", "model.use_peft=true", "--set",
                 "model.lora_target_modules=q_proj,qkv"],
    )  # fmt: skip
    assert code == 2 and "model.lora_target_modules" in out and "all-linear" in out, out


@pytest.mark.slow
def test_lora_grpo_learns_the_builtin_task(tmp_path):
    """examples/quickstart-lora.yaml (adapters on every projection and on lm_head) through the installed
    command: reward <= 0.1 at the start, >= 0.8 by the end (400 steps), and it learns to stop: ended right
    after the 8 letters in >= 80% of the last 20 steps' completions (0.96 measured, seed 0)."""
    from helpers import console_script

    run = tmp_path / "run"
    argv = [console_script(), "train", str(ROOT / "examples" / "quickstart-lora.yaml"), "--gpus", "cpu"]
    argv += ["--set", f"output.dir={run}"]
    p = subprocess.run(argv, capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=1800)
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward"] for m in metrics]
    assert len(rewards) == 400
    assert max(rewards[:5]) <= 0.1 and sum(rewards[-10:]) / 10 >= 0.8, (rewards[:5], rewards[-10:])
    stopped = [m["rewards/repeat_stopped/mean"] for m in metrics[-20:]]
    assert sum(stopped) / 20 >= 0.8, stopped
    assert (run / "final" / "adapter_config.json").is_file()
