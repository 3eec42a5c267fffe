"""The group-relative RL loop (GRPO / GSPO / Dr.GRPO / DAPO), the same on 1 and N processes.

    gpufleet train examples/quickstart.yaml          # one process: this file's `train()` does the work
    gpufleet train job.yaml --gpus auto              # N processes: torchrun workers call `train()` too

Per optimizer step: every `steps_per_generation * num_iterations` steps, sample and score a generation
batch (rl/step.py `generation_step`); then take this step's `per_device_batch` rows of it and take one
optimizer step on them (`optimizer_step`); log metrics, samples and the progress line; checkpoint every
`output.save_every` steps and at the end; save the final model.

Where to start is decided before this runs (the launcher checks the checkpoint against the job,
rl/resume.py `decide`): `train` gets the checkpoint to resume from, or None.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch
import yaml

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime, all_gather_rows, all_reduce_sum
from gpufleet.engine.heap import keep_freed_memory
from gpufleet.monitor.memory import planned_bytes
from gpufleet.monitor.metrics import JsonlWriter, Progress
from gpufleet.monitor.steplog import StepLog
from gpufleet.monitor.stepstats import step_stats
from gpufleet.rl import refsync, resume, rollouts, scorer
from gpufleet.rl.advantages import nanstd
from gpufleet.rl.batch import Scored, reuse_count
from gpufleet.rl.optim import build_optimizer
from gpufleet.rl.parts import build, sharded
from gpufleet.rl.precision import autocast_for, reference_dtype, reward_model_dtype
from gpufleet.rl.step import generation_step
from gpufleet.rl.update import optimizer_step


def train(
    job: Job, out_dir: Path, rt: Runtime | None = None, log=print, *, resume_from: Path | None = None
) -> dict[str, float]:
    """Run the job from step 0, or from the checkpoint `resume_from`; write metrics, samples,
    checkpoints and the final model. Returns the last step's metrics."""
    rt = rt or Runtime()
    keep_freed_memory()  # each step's tensors reuse the last step's pages (engine/heap.py)
    t, o = job.train, job.output
    p = build(job, rt, weights=resume_from, run_dir=out_dir)
    if rt.is_main:
        _say_sharded(p, log)
    opt, sched = build_optimizer(p.train_model.parameters(), t)
    autocast = autocast_for(job, rt.device, rt.policy_size)
    reuse = reuse_count(job)
    start, scored = 0, None
    if resume_from is not None:
        start, scored = resume.restore(p, opt, sched, resume_from, out_dir)
    job_yaml = _job_yaml(job, out_dir)
    metrics_log = StepLog(job, out_dir, rt.device.type == "cuda", log) if rt.is_main else None
    samples_log = JsonlWriter(out_dir / "samples.jsonl") if rt.is_main else None
    progress = Progress(t.max_steps, start)
    last: dict[str, float] = {}
    planned = planned_bytes(out_dir, rt.local_rank)
    p.train_model.train()
    for step in range(start, t.max_steps):
        fault_injection(rt, step + 1)
        t0 = time.perf_counter()
        rt.clock.start_step()
        if step % reuse == 0:
            with rt.clock.phase("generate"):
                scored = generation_step(p, step // reuse, autocast)
        part = step % t.steps_per_generation
        rows = scored.batch.rows(part * t.per_device_batch, (part + 1) * t.per_device_batch)
        m = optimizer_step(p, rows, opt, autocast)
        opt.zero_grad(set_to_none=True)  # rollout and scoring run without the gradients (plan/build.py)
        if p.remote is not None:  # the rollout rank's copy is now behind: the next request pushes
            p.remote.stepped()
            m["timing/weight_sync"] = p.remote.take_sync_seconds()
            m["timing/rollout_wait"] = p.remote.take_wait_seconds()
            if job.env.name or job.rollout.tools:  # envs / tools are called there: their time in the batch
                m["timing/rollout_env"] = p.remote.take_env_seconds()
        if refsync.due(job, step + 1):
            _sync_reference(p)
        m["learning_rate"] = sched.get_last_lr()[0]
        sched.step()
        m.update(_rollout_metrics(rt, scored, p.rewards.labels))
        tokens = float(all_reduce_sum(rt, float(scored.batch.attention_mask.sum())))
        if step + 1 == t.max_steps or (o.save_every and (step + 1) % o.save_every == 0):
            with rt.clock.phase("checkpoint"):
                resume.save(p, opt, sched, step + 1, scored, out_dir, job_yaml)
        seconds = rt.clock.end_step()
        m["step_time"] = time.perf_counter() - t0  # measured apart: the phases must add up to it
        m |= step_stats(rt, seconds, m["step_time"], planned)
        if job.env.name:  # the share of this step spent waiting on envs
            m["timing/env_share"] = m["timing/env"] / m["step_time"]
        m["tokens_per_s"] = tokens / reuse / m["step_time"]
        m["step"] = step + 1
        if rt.is_main:
            metrics_log.write(m)  # metrics.jsonl, TensorBoard / W&B, warnings (monitor/steplog.py)
            if t.samples_every and (step + 1) % t.samples_every == 0 and step % reuse == 0:
                _write_samples(samples_log, step + 1, scored)
            if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
                log(progress.line(step + 1, m))
        last = m
    if rt.scorers:
        scorer.stop(rt)
    rollouts.stop(p.remote)
    if rt.is_main:
        metrics_log.close()
        samples_log.close()
    resume.save_final(p, out_dir / "final")
    return last


def _say_sharded(p, log) -> None:
    """One line per frozen model sharded over the policy ranks (FSDP): the reference, the reward model."""
    job, rt = p.job, p.rt
    if not sharded(job, rt):
        return
    over = f"sharded with FSDP2 over {rt.policy_size} policy ranks"
    if p.reference is not None:
        log(f"reference: {over} ({reference_dtype(job)})")
    if job.reward.model and not rt.dedicated("reward"):
        log(f"reward model: {over} ({reward_model_dtype(job)})")


def _sync_reference(p) -> None:
    """TR-DPO: mix the policy into the colocated reference now, or queue it for the scorer rank (sent with
    the next request, before it scores anything)."""
    alpha = p.job.algorithm.ref_model_mixup_alpha
    if p.reference is not None:
        refsync.mix_into(p.reference, dict(p.policy.named_parameters()), alpha)
    elif p.rt.dedicated("reference"):
        p.pending_ref_mixes.append((alpha, refsync.policy_copy(p.policy)))


def _job_yaml(job: Job, out_dir: Path) -> str:
    """The job file saved with every checkpoint: the launcher's job.yaml, or this job dumped."""
    path = out_dir / "job.yaml"
    if path.exists():
        return path.read_text(encoding="utf-8")
    return yaml.safe_dump(job.model_dump(mode="json"))


def fault_injection(rt: Runtime, step: int) -> None:
    """Test-only: GPUFLEET_TEST_CRASH="RANK:STEP[:ATTEMPT]" makes that rank raise at the start of that
    step (only in that torchrun attempt when ATTEMPT is given); with GPUFLEET_TEST_KILL=1 it dies by
    SIGKILL instead."""
    spec = os.environ.get("GPUFLEET_TEST_CRASH", "")
    if not spec:
        return
    rank, _, rest = spec.partition(":")
    at, _, attempt = rest.partition(":")
    if attempt and attempt != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
        return
    if rank == str(rt.rank) and at == str(step):
        if os.environ.get("GPUFLEET_TEST_KILL"):  # as kill -9 would: no exception, no cleanup
            os.kill(os.getpid(), signal.SIGKILL)
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
    m |= {
        k: v
        for k, v in s.stats.items()
        if k.startswith(("env/", "tools/", "timing/", "rollout/", "sampling/"))
    }
    for j, label in enumerate(labels):  # as TRL: over the completions the function scored (not None)
        col = s.per_function[:, j]
        m[f"rewards/{label}/mean"] = float(torch.nanmean(col)) if not torch.isnan(col).all() else math.nan
        m[f"rewards/{label}/std"] = float(nanstd(col)) if col.numel() > 1 else 0.0
    return m | {k: v for k, v in s.logged.items() if k not in m}  # a reward's log_metric (TRL's)


def _write_samples(writer: JsonlWriter, step: int, s: Scored, k: int = 4) -> None:
    """The first k rows; an env job's rows also as a transcript: each piece marked trained (the
    policy's tokens) or not (observations)."""
    for i in range(min(k, len(s.completions))):
        record = {
            "step": step,
            "prompt": s.prompts[i],
            "completion": s.completions[i],
            "reward": None if math.isnan(s.rewards[i]) else float(s.rewards[i]),  # None: unscorable
            "advantage": float(s.batch.advantages[i]),
        }
        if s.segments is not None:
            record["transcript"] = [{"text": text, "trained": mine} for text, mine in s.segments[i]]
        if s.extras and s.extras[i]:  # columns a reward logged with TRL's log_extra
            record["extra"] = s.extras[i]
        writer.write(record)
