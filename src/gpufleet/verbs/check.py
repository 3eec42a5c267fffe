"""`gpufleet check`: every problem of a job at once, with its fix, before anything loads. No torch import."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpufleet.config.batch import batch_note
from gpufleet.config.load import load_job
from gpufleet.config.problems import render_problems, summary
from gpufleet.errors import EXIT_USER_ERROR
from gpufleet.preflight import p2p_env
from gpufleet.text import plural


def check(job: str, sets: Sequence[str], gpus: str, env: Mapping[str, str], nproc: int | None = None) -> int:
    """`gpufleet check`: print every problem with its fix; exit 2 when any is an error. `nproc`: processes
    per node, as `launch --nproc` (= --set launch.nproc_per_node=N)."""
    from gpufleet.hardware import resolve_hardware
    from gpufleet.rules import run_checks

    hw = resolve_hardware(gpus, env)
    r = load_job(job, [*sets, *([f"launch.nproc_per_node={nproc}"] if nproc else [])], env)
    if r.job.script.command:  # a `gpufleet launch` job: launch's own checks (launch --dry-run), nothing runs
        from gpufleet.verbs.launch import launch_command

        return launch_command(job, sets, gpus, env, [], nproc=nproc, dry_run=True)
    problems, ctx = run_checks(r, hw, env)
    print(f"gpufleet check {job}")
    print(f"  hardware: {hw.describe()}")
    print(f"  world:    {ctx.topo.describe()}; {plural(ctx.topo.world_size, 'process', 'processes')}")
    _, p2p_note = p2p_env(hw, ctx.topo.devices, env)
    if p2p_note:
        print(f"  {p2p_note}")
    m = ctx.model
    if m is not None:
        print(
            f"  model:    {r.job.model.path} ({m.model_type}, {m.num_attention_heads} heads, "
            f"{m.num_key_value_heads} KV heads, {m.max_position_embeddings} positions)"
        )
    t, g = r.job.train, r.job.algorithm.num_generations
    total = r.job.generation_batch(ctx.topo.policy_ranks)
    accum = max(t.per_device_batch // max(t.micro_batch or 1, 1), 1)
    print(
        f"  batch:    generation batch {total} = {t.per_device_batch} per device x "
        f"{plural(ctx.topo.policy_ranks, 'policy rank')} x {plural(t.steps_per_generation, 'step')}; "
        f"{g} generations per prompt; micro-batch {t.micro_batch} ({plural(accum, 'accumulation step')})"
    )
    for note in [batch_note(r, ctx.topo.policy_ranks), *ctx.notes]:
        if note:
            print(f"  {note}")
    if problems:
        print(render_problems(problems))
    print(summary(problems))
    return EXIT_USER_ERROR if any(p.severity == "error" for p in problems) else 0
