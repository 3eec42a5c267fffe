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
import yaml

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime, all_gather_rows, all_reduce_sum, all_true
from gpufleet.errors import UserError
from gpufleet.monitor.metrics import JsonlWriter, Progress
from gpufleet.rl import resume, scorer
from gpufleet.rl.advantages import combine_rewards, group_advantages
from gpufleet.rl.batch import (
    GenerationBatch,
    Scored,
    completion_seed,
    logprobs_of,
    rank_rows,
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
    rt: Runtime
    policy: torch.nn.Module  # the plain model (generation, saving)
    train_model: torch.nn.Module  # what the loss goes through: the policy, its DDP wrapper, or FSDP
    reference: torch.nn.Module | None  # colocated reference model (None: not used, or on a scorer)
    tokenizer: object
    source: PromptSource
    rewards: Rewards

    @property
    def device(self) -> torch.device:
        return self.rt.device


def model_dtype(job: Job) -> str:
    if job.model.dtype != "auto":
        return job.model.dtype
    return "float32"  # master weights in fp32; bf16/fp16 compute comes from autocast


def build(job: Job, rt: Runtime | None = None, weights: Path | None = None) -> Parts:
    """Load everything; `weights`: a checkpoint folder to take the policy weights from (resume)."""
    from transformers.utils import logging as hf_logging

    from gpufleet.models import load_causal_lm, load_tokenizer

    rt = rt or Runtime()
    hf_logging.disable_progress_bar()
    torch.manual_seed(job.train.seed)
    tokenizer = load_tokenizer(job.model.path)
    policy = load_causal_lm(str(weights or job.model.path), dtype=model_dtype(job), device=str(rt.device))
    if job.model.gradient_checkpointing:
        # transformers 5.x: activation_checkpointing_enable (gradient_checkpointing_enable is deprecated)
        policy.activation_checkpointing_enable({"use_reentrant": False})
    train_model = policy
    if rt.distributed and rt.policy_size > 1:
        from gpufleet.parallel import wrap_policy

        train_model = wrap_policy(policy, job.placement.strategy, rt)
    reference = None
    if job.algorithm.beta > 0 and not rt.dedicated("reference"):
        reference = load_causal_lm(job.model.path, dtype=model_dtype(job), device=str(rt.device)).eval()
        reference.requires_grad_(False)
    source = PromptSource(job.data, job.train.seed)
    rewards = Rewards(job.reward, source.reward_names(), rt.device, model_here=not rt.dedicated("reward"))
    return Parts(job, rt, policy, train_model, reference, tokenizer, source, rewards)


def autocast_for(job: Job, device: torch.device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.train.precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def generation_step(p: Parts, gen_index: int, autocast) -> Scored:
    """Sample, reward and score this rank's rows of generation batch `gen_index` (see rl/batch.py)."""
    job, rt = p.job, p.rt
    a, ro, t = job.algorithm, job.rollout, job.train
    G = a.num_generations
    total = t.per_device_batch * rt.policy_size * t.steps_per_generation
    first_prompt = gen_index * (total // G)
    rows = rank_rows(rt.policy_index, rt.policy_size, t.per_device_batch, t.steps_per_generation)
    positions = sorted({first_prompt + j // G for j in rows})
    examples = {pos: p.source.examples(pos, 1)[0] for pos in positions}
    field = p.source.field
    ids_by_pos, text_by_pos = {}, {}
    ids, texts = tokenize_prompts(
        p.tokenizer, [examples[pos][field] for pos in positions], ro.max_prompt_length
    )
    for pos, i, x in zip(positions, ids, texts, strict=True):
        ids_by_pos[pos], text_by_pos[pos] = i, x
    row_pos = [first_prompt + j // G for j in rows]
    fsdp = rt.distributed and job.placement.strategy == "fsdp" and rt.policy_size > 1
    rollout = generate(
        p.train_model if fsdp else p.policy,
        [ids_by_pos[pos] for pos in row_pos],
        seeds=[completion_seed(t.seed, first_prompt + j // G, j % G) for j in rows],
        max_new_tokens=ro.max_completion_length,
        eos_token_id=p.tokenizer.eos_token_id,
        pad_token_id=p.tokenizer.pad_token_id,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        all_done=(lambda flag: all_true(rt, flag)) if fsdp else None,
    ).to(p.device)
    completions = p.tokenizer.batch_decode(
        rollout.completion_ids * rollout.completion_mask.long(), skip_special_tokens=True
    )
    prompts = [text_by_pos[pos] for pos in row_pos]
    columns = {k: [examples[pos][k] for pos in row_pos] for k in examples[positions[0]] if k != field}
    batch = GenerationBatch(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        completion_mask=rollout.completion_mask.float(),
        advantages=torch.zeros(len(rows)),
        old_logprobs=None,
        ref_logprobs=None,
        completion_start=rollout.completion_start,
    )
    scored_remote: dict = {}
    if rt.scorers:
        scored_remote = scorer.request(
            rt,
            {
                "input_ids": batch.input_ids.cpu(),
                "completion_start": batch.completion_start,
                "attention_mask": batch.attention_mask.cpu(),
                "prompts": prompts,
                "completions": completions,
            },
        )
    per_function = p.rewards(prompts, completions, columns, scored_remote.get("rm_scores"))
    # Advantages need every completion of a group: gather all rewards, in global row order.
    gathered = all_gather_rows(rt, per_function)
    order = [
        j
        for r in range(rt.policy_size)
        for j in rank_rows(r, rt.policy_size, t.per_device_batch, t.steps_per_generation)
    ]
    per_function_all = torch.empty(total, per_function.shape[1])
    per_function_all[torch.tensor(order)] = torch.cat(gathered)
    rewards_all = combine_rewards(per_function_all, p.rewards.weights)
    advantages, stats = group_advantages(rewards_all, G, scale=a.scale_rewards)
    batch.advantages = advantages[torch.tensor(rows)].to(p.device)
    micro = t.micro_batch or t.per_device_batch
    if (
        t.steps_per_generation * a.num_iterations > 1
    ):  # the batch is reused: keep the generating policy's log-probs
        batch.old_logprobs = logprobs_of(p.train_model, batch, ro.temperature, micro, autocast)
    if p.reference is not None:
        batch.ref_logprobs = logprobs_of(p.reference, batch, ro.temperature, micro, autocast)
    elif "ref_logprobs" in scored_remote:
        batch.ref_logprobs = scored_remote["ref_logprobs"].to(p.device)
    return Scored(batch, rollout, prompts, completions, rewards_all, per_function_all, stats)


def optimizer_step(p: Parts, batch: GenerationBatch, opt, autocast) -> dict[str, float]:
    """Accumulate over micro-batches with the step-wide normaliser; clip; step. Returns loss metrics.

    Normalisers are global (over all policy ranks): rows for grpo, valid tokens for dapo, rows x
    max_completion_length for dr_grpo; bnpo uses this rank's tokens, as its definition says. DDP and
    FSDP average gradients over ranks, so the loss is multiplied by the rank count to make the reduced
    gradient the gradient of the global loss.
    """
    a, t, rt = p.job.algorithm, p.job.train, p.rt
    n_rows, n_tokens = batch.input_ids.shape[0], batch.num_tokens
    global_tokens = int(all_reduce_sum(rt, float(n_tokens)).item())
    normalizer = {
        "grpo": n_rows * rt.policy_size,
        "bnpo": max(n_tokens, 1),
        "dapo": max(global_tokens, 1),
        "dr_grpo": n_rows * rt.policy_size * p.job.rollout.max_completion_length,
    }[a.loss_type]
    scale = rt.policy_size if a.loss_type != "bnpo" else 1
    totals = {
        "loss": 0.0,
        "kl": 0.0,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/region_mean": 0.0,
        "entropy": 0.0,
    }
    opt.zero_grad(set_to_none=True)
    micro_batches = batch.split(t.micro_batch or t.per_device_batch)
    for k, mb in enumerate(micro_batches):
        sync = k == len(micro_batches) - 1
        with no_sync(p.train_model, sync), autocast():
            logp, entropy = sequence_logprobs(
                p.train_model,
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
            (loss * scale).backward()
        share = mb.num_tokens / max(global_tokens, 1)
        totals["loss"] += loss.item()
        for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            totals[key] += stats[key] * share
        with torch.no_grad():
            totals["entropy"] += float((entropy.float() * mb.completion_mask).sum()) / max(global_tokens, 1)
    max_norm = t.max_grad_norm if t.max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(p.train_model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        raise UserError(
            f"the gradient norm is {grad_norm.item()} (non-finite).",
            field="train.learning_rate",
            fix="lower train.learning_rate or use train.precision=fp32",
        )
    opt.step()
    # Metrics: token-weighted shares were taken of the global count, so a sum over ranks is the mean.
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        totals[key] = float(all_reduce_sum(rt, totals[key]))
    totals["loss"] = (
        float(all_reduce_sum(rt, totals["loss"]))
        if a.loss_type != "bnpo"
        else float(all_reduce_sum(rt, totals["loss"])) / rt.policy_size
    )
    totals["grad_norm"] = float(grad_norm)
    return totals


def no_sync(model, sync: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch."""
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def train(job: Job, out_dir: Path, rt: Runtime | None = None, log=print) -> dict[str, float]:
    """Run the job (resuming when a checkpoint says so); write metrics, samples, checkpoints and the
    final model. Returns the last step's metrics."""
    import os

    rt = rt or Runtime()
    t, a, o = job.train, job.algorithm, job.output
    ckpt = resume.start_point(job, out_dir, rt)
    if ckpt is not None:
        resume.check(ckpt, job, t.per_device_batch * rt.policy_size)
    p = build(job, rt, weights=ckpt)
    opt, sched = build_optimizer(p.train_model.parameters(), t)
    autocast = autocast_for(job, rt.device)
    reuse = t.steps_per_generation * a.num_iterations
    start, scored = 0, None
    if ckpt is not None:
        start, scored = resume.restore(p, opt, sched, ckpt, out_dir)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt != "0":  # the launcher announced the first start; a torchrun restart is news
            log(f"restart {attempt}: resuming from {ckpt} at step {start}")
    job_yaml = (
        (out_dir / "job.yaml").read_text(encoding="utf-8")
        if (out_dir / "job.yaml").exists()
        else yaml.safe_dump(job.model_dump(mode="json"))
    )
    metrics_log = JsonlWriter(out_dir / "metrics.jsonl") if rt.is_main else None
    samples_log = JsonlWriter(out_dir / "samples.jsonl") if rt.is_main else None
    progress = Progress(t.max_steps, start)
    last: dict[str, float] = {}
    p.train_model.train()
    for step in range(start, t.max_steps):
        fault_injection(rt, step + 1)
        t0 = time.perf_counter()
        if step % reuse == 0:
            scored = generation_step(p, step // reuse, autocast)
        part = step % t.steps_per_generation
        rows = scored.batch.rows(part * t.per_device_batch, (part + 1) * t.per_device_batch)
        m = optimizer_step(p, rows, opt, autocast)
        m["learning_rate"] = sched.get_last_lr()[0]
        sched.step()
        m.update(_rollout_metrics(p.rt, scored, p.rewards.labels))
        m["step_time"] = time.perf_counter() - t0
        m["tokens_per_s"] = (
            float(all_reduce_sum(rt, float(scored.batch.attention_mask.sum()))) / reuse / m["step_time"]
        )
        m["step"] = step + 1
        if rt.is_main:
            metrics_log.write(m)
            if t.samples_every and (step + 1) % t.samples_every == 0 and step % reuse == 0:
                _write_samples(samples_log, step + 1, scored)
            if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
                log(progress.line(step + 1, m))
        last = m
        if step + 1 == t.max_steps or (o.save_every and (step + 1) % o.save_every == 0):
            resume.save(p, opt, sched, step + 1, scored, out_dir, job_yaml)
    if rt.scorers:
        scorer.stop(rt)
    if rt.is_main:
        metrics_log.close()
        samples_log.close()
    resume.save_final(p, out_dir / "final")
    return last


def fault_injection(rt: Runtime, step: int) -> None:
    """Test-only: GPUFLEET_TEST_CRASH="RANK:STEP[:ATTEMPT]" makes that rank raise at the start of that
    step (only in that torchrun attempt when ATTEMPT is given)."""
    import os

    spec = os.environ.get("GPUFLEET_TEST_CRASH", "")
    if not spec:
        return
    rank, _, rest = spec.partition(":")
    at, _, attempt = rest.partition(":")
    if attempt and attempt != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
        return
    if rank == str(rt.rank) and at == str(step):
        raise RuntimeError(f"injected crash on rank {rt.rank} at step {step} (GPUFLEET_TEST_CRASH)")


def _rollout_metrics(rt: Runtime, s: Scored, labels: list[str]) -> dict[str, float]:
    lengths = torch.cat(all_gather_rows(rt, s.rollout.completion_lengths.float().cpu()))
    truncated = torch.cat(all_gather_rows(rt, s.rollout.is_truncated.float().cpu()))
    m = {
        "reward": s.stats["reward"],
        "reward_std": s.stats["reward_std"],
        "frac_reward_zero_std": s.stats["frac_reward_zero_std"],
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.mean()),
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
