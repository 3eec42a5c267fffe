"""The group-relative RL loop (GRPO / GSPO / Dr.GRPO / DAPO) on one process.

    gpufleet train examples/quickstart.yaml          # this file's `train()` does the work

Per optimizer step: every `steps_per_generation * num_iterations` steps, sample a generation batch
(G completions per prompt), reward it, compute group advantages (and old / reference log-probs when
they are needed); then take this step's `per_device_batch` rows, split them into micro-batches,
accumulate gradients with each micro-batch's loss scaled by the *whole step's* normaliser (so the
gradient does not depend on `train.micro_batch`), clip, and step.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpufleet.config.schema import Job
from gpufleet.errors import UserError
from gpufleet.monitor.metrics import JsonlWriter, Progress
from gpufleet.rl.advantages import combine_rewards, group_advantages
from gpufleet.rl.batch import (
    GenerationBatch,
    Scored,
    completion_seeds,
    logprobs_of,
    tokenize_prompts,
)
from gpufleet.rl.data import PromptSource
from gpufleet.rl.losses import policy_loss
from gpufleet.rl.optim import build_optimizer
from gpufleet.rl.rewards import Rewards
from gpufleet.rl.rollout import generate, sequence_logprobs


@dataclass
class Parts:
    """Everything the loop needs, built once by `build`."""

    job: Job
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    tokenizer: object
    source: PromptSource
    rewards: Rewards
    device: torch.device


def _dtype(job: Job) -> str:
    if job.model.dtype != "auto":
        return job.model.dtype
    return "float32"  # master weights in fp32; bf16/fp16 compute comes from autocast


def build(job: Job, device: torch.device) -> Parts:
    from transformers.utils import logging as hf_logging

    from gpufleet.models import load_causal_lm, load_tokenizer

    hf_logging.disable_progress_bar()
    torch.manual_seed(job.train.seed)
    tokenizer = load_tokenizer(job.model.path)
    policy = load_causal_lm(job.model.path, dtype=_dtype(job), device=str(device))
    if job.model.gradient_checkpointing:
        # transformers 5.x: activation_checkpointing_enable (gradient_checkpointing_enable is deprecated)
        policy.activation_checkpointing_enable({"use_reentrant": False})
    reference = None
    if job.algorithm.beta > 0:
        reference = load_causal_lm(job.model.path, dtype=_dtype(job), device=str(device)).eval()
        reference.requires_grad_(False)
    source = PromptSource(job.data, job.train.seed)
    rewards = Rewards(job.reward, source.reward_names(), device)
    return Parts(job, policy, reference, tokenizer, source, rewards, device)


def autocast_for(job: Job, device: torch.device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.train.precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def generation_step(p: Parts, gen_index: int, autocast) -> Scored:
    """Sample, reward and score one generation batch (`gen_index` counts generation batches)."""
    job = p.job
    a, ro, t = job.algorithm, job.rollout, job.train
    rows = t.per_device_batch * t.steps_per_generation
    num_prompts = rows // a.num_generations
    start = gen_index * num_prompts
    examples = p.source.examples(start, num_prompts)
    field = p.source.field
    prompt_ids, prompt_texts = tokenize_prompts(
        p.tokenizer, [e[field] for e in examples], ro.max_prompt_length
    )
    G = a.num_generations
    rollout = generate(
        p.policy,
        [ids for ids in prompt_ids for _ in range(G)],
        seeds=completion_seeds(t.seed, list(range(start, start + num_prompts)), G),
        max_new_tokens=ro.max_completion_length,
        eos_token_id=p.tokenizer.eos_token_id,
        pad_token_id=p.tokenizer.pad_token_id,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
    ).to(p.device)
    completions = p.tokenizer.batch_decode(
        rollout.completion_ids * rollout.completion_mask.long(), skip_special_tokens=True
    )
    prompts = [x for x in prompt_texts for _ in range(G)]
    columns = {k: [e[k] for e in examples for _ in range(G)] for k in examples[0] if k != field}
    per_function = p.rewards(prompts, completions, columns)
    rewards = combine_rewards(per_function, p.rewards.weights)
    advantages, stats = group_advantages(rewards, G, scale=a.scale_rewards)
    batch = GenerationBatch(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        completion_mask=rollout.completion_mask.float(),
        advantages=advantages.to(p.device),
        old_logprobs=None,
        ref_logprobs=None,
        completion_start=rollout.completion_start,
    )
    micro = t.micro_batch or t.per_device_batch
    if (
        t.steps_per_generation * a.num_iterations > 1
    ):  # the batch is reused: keep the generating policy's log-probs
        batch.old_logprobs = logprobs_of(p.policy, batch, ro.temperature, micro, autocast)
    if p.reference is not None:
        batch.ref_logprobs = logprobs_of(p.reference, batch, ro.temperature, micro, autocast)
    return Scored(batch, rollout, prompts, completions, rewards, per_function, stats)


def optimizer_step(p: Parts, batch: GenerationBatch, opt, autocast) -> dict[str, float]:
    """Accumulate over micro-batches with the step-wide normaliser; clip; step. Returns loss metrics."""
    a, t = p.job.algorithm, p.job.train
    n_rows, n_tokens = batch.input_ids.shape[0], batch.num_tokens
    normalizer = {
        "grpo": n_rows,
        "bnpo": max(n_tokens, 1),
        "dapo": max(n_tokens, 1),
        "dr_grpo": n_rows * p.job.rollout.max_completion_length,
    }[a.loss_type]
    totals = {
        "loss": 0.0,
        "kl": 0.0,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/region_mean": 0.0,
        "entropy": 0.0,
    }
    opt.zero_grad(set_to_none=True)
    for mb in batch.split(t.micro_batch or t.per_device_batch):
        with autocast():
            logp, entropy = sequence_logprobs(
                p.policy,
                mb.input_ids,
                mb.attention_mask,
                mb.completion_start,
                temperature=p.job.rollout.temperature,
            )
        logp = logp.float()
        old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
        loss, stats = policy_loss(
            logp,
            old,
            mb.advantages,
            mb.completion_mask,
            ref_logprobs=mb.ref_logprobs,
            loss_type=a.loss_type,
            level=a.importance_level,
            epsilon=a.epsilon,
            epsilon_high=a.epsilon_high,
            beta=a.beta,
            max_completion_length=p.job.rollout.max_completion_length,
            normalizer=normalizer,
        )
        if not torch.isfinite(loss):
            bad = (~torch.isfinite(logp) & mb.completion_mask.bool()).any(dim=1).nonzero()
            row = int(bad[0]) if len(bad) else 0
            raise UserError(
                f"the loss is {loss.item()} (non-finite) in a micro-batch; first bad row {row}.",
                field="train.learning_rate",
                fix="lower train.learning_rate, use train.precision=fp32, or set train.max_grad_norm=1.0",
            )
        loss.backward()
        share = mb.num_tokens / max(n_tokens, 1)
        totals["loss"] += loss.item()
        for k in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            totals[k] += stats[k] * share
        with torch.no_grad():
            totals["entropy"] += float((entropy.float() * mb.completion_mask).sum()) / max(n_tokens, 1)
    max_norm = t.max_grad_norm if t.max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(p.policy.parameters(), max_norm)
    if not torch.isfinite(grad_norm):
        raise UserError(
            f"the gradient norm is {grad_norm.item()} (non-finite).",
            field="train.learning_rate",
            fix="lower train.learning_rate or use train.precision=fp32",
        )
    opt.step()
    totals["grad_norm"] = float(grad_norm)
    return totals


def train(job: Job, out_dir: Path, device: torch.device | None = None, log=print) -> dict[str, float]:
    """Run the job; write metrics.jsonl, samples.jsonl and the final model. Returns the last metrics."""
    device = device or torch.device("cpu")
    p = build(job, device)
    opt, sched = build_optimizer(p.policy.parameters(), job.train)
    autocast = autocast_for(job, device)
    t, a = job.train, job.algorithm
    reuse = t.steps_per_generation * a.num_iterations
    metrics_log = JsonlWriter(out_dir / "metrics.jsonl")
    samples_log = JsonlWriter(out_dir / "samples.jsonl")
    progress = Progress(t.max_steps)
    scored: Scored | None = None
    last: dict[str, float] = {}
    p.policy.train()
    for step in range(t.max_steps):
        t0 = time.perf_counter()
        if step % reuse == 0:
            scored = generation_step(p, step // reuse, autocast)
        part = step % t.steps_per_generation
        rows = scored.batch.rows(part * t.per_device_batch, (part + 1) * t.per_device_batch)
        m = optimizer_step(p, rows, opt, autocast)
        m["learning_rate"] = sched.get_last_lr()[0]
        sched.step()
        m.update(_rollout_metrics(scored, p.rewards.labels))
        m["step_time"] = time.perf_counter() - t0
        m["tokens_per_s"] = float(scored.batch.attention_mask.sum()) / reuse / m["step_time"]
        m["step"] = step + 1
        metrics_log.write(m)
        if t.samples_every and (step + 1) % t.samples_every == 0 and step % reuse == 0:
            _write_samples(samples_log, step + 1, scored)
        if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
            log(progress.line(step + 1, m))
        last = m
    metrics_log.close()
    samples_log.close()
    save_final(p, out_dir / "final")
    return last


def _rollout_metrics(s: Scored, labels: list[str]) -> dict[str, float]:
    lengths = s.rollout.completion_lengths.float()
    m = {
        "reward": s.stats["reward"],
        "reward_std": s.stats["reward_std"],
        "frac_reward_zero_std": s.stats["frac_reward_zero_std"],
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(s.rollout.is_truncated.float().mean()),
    }
    for j, label in enumerate(labels):
        col = s.per_function[:, j]
        m[f"rewards/{label}/mean"] = float(torch.nanmean(col)) if not torch.isnan(col).all() else math.nan
    return m


def _write_samples(writer: JsonlWriter, step: int, s: Scored, k: int = 4) -> None:
    for i in range(min(k, len(s.completions))):
        writer.write(
            {
                "step": step,
                "prompt": s.prompts[i],
                "completion": s.completions[i],
                "reward": float(s.rewards[i]),
                "advantage": float(s.batch.advantages[i]),
            }
        )


def save_final(p: Parts, folder: Path) -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: never a half-written model."""
    import shutil

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    p.policy.save_pretrained(tmp, safe_serialization=True)
    p.tokenizer.save_pretrained(tmp)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old)
    else:
        tmp.rename(folder)
