"""`gpufleet train`: check everything, prepare the run directory, then train in-process (1 process)
or through torchrun (N processes), and print where the results are or why it failed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.commands import render_problems, render_yaml, summary
from gpufleet.config.checks import run_checks
from gpufleet.config.load import load_job
from gpufleet.config.resources import holds_run
from gpufleet.errors import EXIT_USER_ERROR
from gpufleet.hardware import resolve_hardware


def train_command(
    job: str,
    sets: Sequence[str],
    gpus: str,
    env: Mapping[str, str],
    *,
    print_launch: bool = False,
    force: bool = False,
) -> int:
    hw = resolve_hardware(gpus, env)
    r = load_job(job, sets, env)
    problems, ctx = run_checks(r, hw, env)
    auto_sets = _auto_placement(r, hw, env) if not any(p.severity == "error" for p in problems) else []
    if auto_sets:  # `placement: auto` decided by memory: the planner's dedicated device, made explicit
        print(f"placement auto -> {' '.join(auto_sets)} (gpufleet plan explains why)")
        r = load_job(job, [*sets, *(s.removeprefix("--set ") for s in auto_sets)], env)
        problems, ctx = run_checks(r, hw, env)
    if force:  # --force: a predicted out-of-memory is the user's call; every other rule still holds
        for p in problems:
            if p.extra.get("rule") == "fit" and p.severity == "error":
                p.severity = "warning"
    if any(p.severity == "error" for p in problems):
        print(render_problems(problems), file=sys.stderr)
        print(summary(problems) + " Nothing was started.", file=sys.stderr)
        return EXIT_USER_ERROR
    for p in problems:
        print(p.render())
    topo, jb = ctx.topo, r.job
    out = Path(jb.output.dir).expanduser()
    job_file = out / "job.yaml"
    if print_launch:
        from gpufleet.launch.torchrun import describe_launch

        if topo.world_size == 1:
            print(f"# one process: gpufleet train {job} runs in-process (no torchrun)")
        else:
            print(describe_launch(jb, topo, job_file, cpu=hw.is_cpu, job_arg=job))
        return 0
    from gpufleet import checkpoint
    from gpufleet.errors import UserError

    try:
        ckpt = checkpoint.resolve_resume(out, jb.output.resume)
    except UserError as e:
        print(f"gpufleet: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if ckpt is not None:
        from gpufleet.rl.resume import check

        try:
            changes = check(ckpt, jb, jb.train.per_device_batch * topo.policy_ranks)
        except UserError as e:
            print(f"gpufleet: error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        done = checkpoint.load_state(ckpt).step
        if done >= jb.train.max_steps:
            print(
                f"{out} already holds a finished run ({done} steps; model in {out / 'final'}); nothing to do."
            )
            print(
                f"Train longer with --set train.max_steps=<more>, or start another with --set output.dir="
                f"{str(out).rstrip('/')}-2"
            )
            return 0
        print(f"resuming from {ckpt} (step {done})" + (f"; changed: {'; '.join(changes)}" if changes else ""))
    elif holds_run(out):  # a run that never reached a checkpoint: its logs are kept aside, not overwritten
        for name in ("metrics.jsonl", "samples.jsonl"):
            if (out / name).exists():
                (out / name).replace(out / f"{name}.previous")
    out.mkdir(parents=True, exist_ok=True)
    # Atomic: on a shared file system every node writes this file, and workers read it.
    tmp = job_file.with_name(f".job.yaml.{os.getpid()}")
    tmp.write_text(render_yaml(r) + "\n", encoding="utf-8")
    os.replace(tmp, job_file)
    a, t = jb.algorithm, jb.train
    print(f"gpufleet train {job}: {jb.model.path}; {topo.describe()}; {hw.describe()}", flush=True)
    print(
        f"  {a.name}: G={a.num_generations}, loss {a.loss_type}, {a.importance_level} level, beta {a.beta}; "
        f"{t.max_steps} steps x {t.per_device_batch * topo.policy_ranks} completions; data {jb.data.path}; "
        f"output {out}",
        flush=True,
    )
    if topo.world_size == 1:
        code = _in_process(jb, out, hw, topo)
    else:
        code = _torchrun(jb, topo, job_file, out, hw, env)
    if code == 0:
        print(f"  model:   {out / 'final'}  (AutoModelForCausalLM.from_pretrained)")
        print(f"  metrics: {out / 'metrics.jsonl'}")
        print(f"  samples: {out / 'samples.jsonl'}")
    return code


def _auto_placement(r, hw, env) -> list[str]:
    """The flags that turn `auto` reference/reward placements into the planner's choice ([] = colocate)."""
    pl = r.job.placement
    if hw.is_cpu or "auto" not in (pl.reference, pl.reward):
        return []
    from gpufleet.errors import UserError
    from gpufleet.plan.placement import make_plan

    try:
        plan, _ = make_plan(r, hw, env)
    except UserError:  # the model cannot be sized offline: keep the default (colocate)
        return []
    return list(plan.sets) if plan is not None and plan.sets else []


def _in_process(job, out: Path, hw, topo) -> int:
    import torch

    from gpufleet.dist import Runtime
    from gpufleet.rl.trainer import train

    device = torch.device("cpu") if hw.is_cpu else torch.device("cuda", topo.policy_devices[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    last = train(job, out, Runtime(device=device))
    print(f"done: reward {last.get('reward', float('nan')):.3f} at step {int(last.get('step', 0))}")
    return 0


def _torchrun(job, topo, job_file: Path, out: Path, hw, env) -> int:
    from gpufleet.launch.diagnose import first_failure, unexplained
    from gpufleet.launch.torchrun import torchrun_argv, worker_env

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in logs.glob("rank*.error.json"):
        stale.unlink()
    argv = torchrun_argv(job, topo, job_file, cpu=hw.is_cpu)
    with (logs / "torchrun.log").open("a", encoding="utf-8") as agent_log:
        proc = subprocess.run(argv, env=worker_env(topo, env), stdout=None, stderr=agent_log, check=False)
    if proc.returncode == 0:
        print("done.")
        return 0
    failure = first_failure(logs)
    if failure is None:
        print(unexplained(logs, proc.returncode), file=sys.stderr)
        return 1
    print(failure.summary(logs, proc.returncode), file=sys.stderr)
    return EXIT_USER_ERROR if failure.user_error else 1
