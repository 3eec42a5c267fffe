"""The trainer's side of checkpoints: what to save, how to put it back, and the final model.

A resumed run continues the same trajectory: the weights and AdamW state come back bit for bit,
the LR schedule from its saved state, the data order from the step (the prompt stream is a function
of the position, rl/data.py), sampling from per-completion seeds (rl/batch.py), and the RNG states
of every rank as saved. A checkpoint taken in the middle of reusing a generation batch
(steps_per_generation or num_iterations > 1) also holds that batch.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from gpufleet import checkpoint, continuity
from gpufleet.engine.rollout import Rollout
from gpufleet.errors import UserError
from gpufleet.rl.batch import GenerationBatch, Scored, reuse_count


def layout(p) -> dict:
    rt, t = p.rt, p.job.train
    return {
        "world_size": rt.world_size,
        "policy_ranks": rt.policy_size,
        "strategy": p.job.placement.strategy,
        "per_device_batch": t.per_device_batch,
        "global_batch": t.per_device_batch * rt.policy_size,
    }


def _is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def optimizer_state(p, opt) -> dict | None:
    """Full AdamW state keyed by parameter name (a collective under FSDP; rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = _is_fsdp(p.train_model)
    state = get_optimizer_state_dict(
        p.train_model, opt, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
    )
    return state if p.rt.is_main else None


def save(p, opt, sched, step: int, scored: Scored | None, out_dir: Path, job_yaml: str) -> Path:
    from gpufleet.parallel import full_state_dict

    model_state = full_state_dict(p.train_model, p.rt)
    optim = optimizer_state(p, opt)
    reuse = reuse_count(p.job)
    batch = scored_to_dict(scored) if scored is not None and step % reuse != 0 else None
    in_flight = _in_flight(p)
    if in_flight:  # a rollout rank's batches sampled ahead (rl/rollouts.py): saved, not sampled again
        batch = (batch or {}) | {"in_flight": in_flight}
    return checkpoint.save(
        out_dir,
        step,
        policy=p.policy,
        model_state=model_state,
        tokenizer=p.tokenizer,
        optim_state=optim,
        scheduler=sched.state_dict(),
        layout=layout(p),
        job_yaml=job_yaml,
        rt=p.rt,
        batch=batch,
        keep_last=p.job.output.keep_last,
        controllers={"entropy": p.entropy.state_dict()} if p.entropy.adaptive else None,
        reference_state=_reference_state(p),
    )


def _reference_state(p) -> dict | None:
    """The synced reference's weights to checkpoint: the colocated copy's, or the scorer rank's (asked for,
    together by every policy rank); None without algorithm.sync_ref_model."""
    if not p.job.algorithm.sync_ref_model:
        return None
    if p.reference is not None:
        return p.reference.state_dict()
    if p.rt.dedicated("reference"):
        from gpufleet.rl import scorer

        state = scorer.reference_state(p.rt, p.pending_ref_mixes)
        p.pending_ref_mixes.clear()  # applied by the scorer
        return state
    return None


def check(ckpt: Path, job, global_batch: int, roots: Sequence[str] = ()) -> list[str]:
    """Refuse a checkpoint that this job cannot continue; return the harmless changes to report.
    ``roots``: where the job's modules are found (usercode.roots), to tell a module from its file."""
    breaking, harmless = continuity.against(ckpt, job, global_batch, roots)
    if breaking:
        raise UserError(
            f"cannot resume {ckpt}: the job changed in a way that breaks the run ({'; '.join(breaking)}).",
            field="output.resume",
            fix=f"undo the change, or start a new run: {continuity.new_run(job.output)}",
        )
    return harmless


def restore(p, opt, sched, ckpt: Path, out_dir: Path) -> tuple[int, Scored | None]:
    """Optimizer, scheduler, RNG and (if saved) the batch in use; the weights were loaded by `build`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = checkpoint.load_state(ckpt)
    full = _is_fsdp(p.train_model)
    set_optimizer_state_dict(
        p.train_model, opt, checkpoint.load_optimizer(ckpt), options=StateDictOptions(full_state_dict=full)
    )
    sched.load_state_dict(state.scheduler)
    reference = checkpoint.load_reference(ckpt)
    if reference is not None and p.reference is not None:
        p.reference.load_state_dict(reference)
    elif reference is not None:  # on a scorer rank: sent with the next request, before any sync
        p.pending_ref_mixes.insert(0, ("state", reference))
    if p.entropy.adaptive and "entropy" in state.controllers:
        p.entropy.load_state_dict(state.controllers["entropy"])
    rng = checkpoint.load_rng(ckpt, p.rt.rank)
    if rng is not None:
        checkpoint.set_rng_state(rng)
    saved = checkpoint.load_batch(ckpt, p.rt.rank) or {}
    _restore_in_flight(p, saved.get("in_flight", {}), state.step)
    if p.rt.is_main:
        truncate_jsonl(out_dir / "metrics.jsonl", state.step)
        truncate_jsonl(out_dir / "samples.jsonl", state.step)
    return state.step, (scored_from_dict(saved, p.device) if "batch" in saved else None)


def _in_flight(p) -> dict:
    """The answers a rollout rank sampled ahead, each as tensors and numbers (flushed to this rank first)."""
    from gpufleet.rl import rollouts

    rollouts.flush(p.remote)
    if p.remote is None:
        return {}
    out = {}
    for g, a in p.remote.held.items():
        if a is not None:
            rollout = {f.name: getattr(a.rollout, f.name) for f in fields(a.rollout)}
            out[g] = {"rollout": rollout, "logprobs": a.logprobs, "version": a.version, "played": a.played}
    return out


def _restore_in_flight(p, saved: dict, step: int) -> None:
    """A rollout rank's answers in flight at the checkpoint; the next request is the one after them (or
    the next generation batch's, when none was ahead)."""
    if p.remote is None:
        return
    from gpufleet.rl.rollouts import Answer

    reuse = reuse_count(p.job)
    p.remote.held = {
        int(g): Answer(Rollout(**a["rollout"]), a["logprobs"], int(a["version"]), a.get("played"))
        for g, a in saved.items()
    }
    p.remote.sent = max(p.remote.held) + 1 if p.remote.held else -(-step // reuse)
    p.remote.version = step


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the records of steps after `step` (written after the checkpoint, before the crash)."""
    import json

    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except ValueError:  # a line cut by the crash
            break
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
    os.replace(tmp, path)


def scored_to_dict(s: Scored) -> dict:
    b = {f.name: getattr(s.batch, f.name) for f in fields(s.batch)}
    r = {f.name: getattr(s.rollout, f.name) for f in fields(s.rollout)}
    return {
        "batch": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()},
        "rollout": {k: None if v is None else v.cpu() for k, v in r.items()},  # logprobs: maybe None
        "prompts": list(s.prompts),
        "completions": list(s.completions),
        "rewards": s.rewards,
        "per_function": s.per_function,
        "stats": dict(s.stats),
    }


def scored_from_dict(d: dict, device: torch.device) -> Scored:
    b = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d["batch"].items()}
    return Scored(
        GenerationBatch(**b),
        Rollout(**d["rollout"]).to(device),
        d["prompts"],
        d["completions"],
        d["rewards"],
        d["per_function"],
        d["stats"],
    )


def save_final(p, folder: Path) -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: never a half-written model.

    Under FSDP the full state dict is gathered first (a collective of the policy ranks); rank 0 writes.
    """
    from gpufleet.parallel import full_state_dict

    state = full_state_dict(p.train_model, p.rt)
    if not p.rt.is_main:
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    p.policy.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    p.tokenizer.save_pretrained(tmp)
    checkpoint.readable_by_all(tmp)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old)
    else:
        tmp.rename(folder)


def final_from(ckpt: Path, folder: Path) -> bool:
    """Make `folder` (a run's final/) the model of checkpoint `ckpt`, the last step of a run that stopped
    before writing it (killed after its last checkpoint, or resumed with max_steps lowered to the step
    it reached): True when written. A final/ written after the checkpoint is that model: kept."""
    done = folder / "config.json", folder / "adapter_config.json"
    if (
        any(f.is_file() for f in done)
        and folder.stat().st_mtime >= (ckpt / "trainer_state.json").stat().st_mtime
    ):
        return False
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    checkpoint.copy_model(ckpt, tmp)
    (tmp / "job.yaml").unlink(missing_ok=True)  # the run's own job.yaml says it; final/ holds the model
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return True


@dataclass(frozen=True)
class Start:
    """Where a run starts: the checkpoint to resume from (None: step 0), its step, what changed since."""

    checkpoint: Path | None = None
    step: int = 0
    changes: tuple[str, ...] = ()


def decide(job, out_dir: Path, global_batch: int, roots: Sequence[str] = ()) -> Start:
    """The launcher's decision, made once before any process starts: the checkpoint `output.resume`
    names in `out_dir`, checked against the job (UserError on a change that breaks the run)."""
    ckpt = checkpoint.resolve_resume(out_dir, job.output.resume)
    if ckpt is None:
        return Start()
    changes = check(ckpt, job, global_batch, roots)
    return Start(ckpt, checkpoint.load_state(ckpt).step, tuple(changes))


def worker_start(job, out_dir: Path) -> Start:
    """Where a torchrun worker starts. Attempt 0: the checkpoint the launcher decided on (the same rule on
    the same folder, already checked by `decide`); a torchrun restart: the newest one, written by this
    very run."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    ckpt = checkpoint.resolve_resume(out_dir, "auto" if attempt > 0 else job.output.resume)
    return Start() if ckpt is None else Start(ckpt, checkpoint.load_state(ckpt).step)
