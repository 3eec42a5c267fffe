"""The `check` and `config` verbs: resolve, check, print. No torch import."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence

import yaml

from gpufleet.config.load import Resolved, dump_job, load_job
from gpufleet.config.problems import Problem, format_value
from gpufleet.config.schema import SECTIONS
from gpufleet.errors import EXIT_USER_ERROR


def render_problems(problems: list[Problem]) -> str:
    order = sorted(problems, key=lambda p: p.severity != "error")
    return "\n".join(p.render() for p in order)


def summary(problems: list[Problem]) -> str:
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    if not problems:
        return "ok: no problems found."
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}."


def check(job: str, sets: Sequence[str], gpus: str, env: Mapping[str, str]) -> int:
    """`gpufleet check`: print every problem with its fix; exit 2 when any is an error."""
    from gpufleet.config.checks import generation_batch, run_checks
    from gpufleet.hardware import resolve_hardware

    hw = resolve_hardware(gpus, env)
    r = load_job(job, sets, env)
    problems, ctx = run_checks(r, hw, env)
    print(f"gpufleet check {job}")
    print(f"  hardware: {hw.describe()}")
    print(f"  world:    {ctx.topo.describe()}; {ctx.topo.world_size} process(es)")
    m = ctx.model
    if m is not None:
        print(
            f"  model:    {r.job.model.path} ({m.model_type}, {m.num_attention_heads} heads, "
            f"{m.num_key_value_heads} KV heads, {m.max_position_embeddings} positions)"
        )
    t, g = r.job.train, r.job.algorithm.num_generations
    total = generation_batch(ctx)
    print(
        f"  batch:    generation batch {total} = {t.per_device_batch} per device x {ctx.topo.policy_ranks} "
        f"policy ranks x {t.steps_per_generation} steps; {g} generations per prompt; "
        f"micro-batch {t.micro_batch} ({max(t.per_device_batch // max(t.micro_batch or 1, 1), 1)} accumulation steps)"
    )
    if problems:
        print(render_problems(problems))
    print(summary(problems))
    return EXIT_USER_ERROR if any(p.severity == "error" for p in problems) else 0


def show_config(job: str, sets: Sequence[str], fmt: str, env: Mapping[str, str]) -> int:
    """`gpufleet config`: the resolved job with the source of every value."""
    r = load_job(job, sets, env)
    if fmt == "json":
        data = dump_job(r)
        out = {
            s: {f: {"value": v, "source": str(r.source(f"{s}.{f}"))} for f, v in fields.items()}
            for s, fields in data.items()
        }
        print(json.dumps(out, indent=2))
    elif fmt == "yaml":
        print(render_yaml(r))
    else:
        print(render_table(r))
    if r.problems:
        print(render_problems(r.problems), file=sys.stderr)
        print(summary(r.problems) + " (values above fell back to a lower layer)", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def render_yaml(r: Resolved) -> str:
    """A valid job file of the resolved values, each line commented with its source."""
    data = dump_job(r)
    lines = [
        f"# resolved by gpufleet config from {r.job_path}" if r.job_path else "# resolved by gpufleet config"
    ]
    for section in SECTIONS:
        lines.append(f"{section}:")
        for name, value in data[section].items():
            text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
            text = text.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"  {name}: {text}  # {r.source(f'{section}.{name}')}")
    return "\n".join(lines)


def render_table(r: Resolved) -> str:
    data = dump_job(r)
    rows = [
        (f"{s}.{f}", format_value(v), str(r.source(f"{s}.{f}")))
        for s, fields in data.items()
        for f, v in fields.items()
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = min(max(len(b) for _, b, _ in rows), 40)
    out = [f"{'field'.ljust(w0)}  {'value'.ljust(w1)}  source", "-" * (w0 + w1 + 12)]
    out += [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}" for a, b, c in rows]
    return "\n".join(out)


def train_command(job: str, sets: Sequence[str], gpus: str, env: Mapping[str, str]) -> int:
    """`gpufleet train`: check everything first, then train; print where the results are."""
    from pathlib import Path

    from gpufleet.config.checks import holds_run, run_checks
    from gpufleet.hardware import resolve_hardware

    hw = resolve_hardware(gpus, env)
    r = load_job(job, sets, env)
    problems, ctx = run_checks(r, hw, env)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        print(render_problems(problems), file=sys.stderr)
        print(summary(problems) + " Nothing was started.", file=sys.stderr)
        return EXIT_USER_ERROR
    for p in problems:
        print(p.render())
    if ctx.topo.world_size > 1:
        print(
            f"gpufleet: error: this job asks for {ctx.topo.world_size} processes ({ctx.topo.describe()}); "
            "multi-process launch is not available in this version. Fix: --set launch.nproc_per_node=1",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    out = Path(r.job.output.dir).expanduser()
    if (out / "final" / "config.json").is_file() and r.job.output.resume == "auto":
        print(f"{out} already holds a finished run (final model in {out / 'final'}); nothing to do.")
        print(f"Start another with --set output.dir={str(out).rstrip('/')}-2")
        return 0
    if holds_run(out):  # a run that did not finish: its logs are kept aside, not overwritten
        for name in ("metrics.jsonl", "samples.jsonl"):
            if (out / name).exists():
                (out / name).replace(out / f"{name}.previous")
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.yaml").write_text(render_yaml(r) + "\n", encoding="utf-8")

    import torch

    from gpufleet.rl.trainer import train

    device = torch.device("cuda", ctx.topo.policy_devices[0]) if not hw.is_cpu else torch.device("cpu")
    job_ = r.job
    print(
        f"gpufleet train {job}: {job_.model.path} on {device}; {job_.algorithm.name} "
        f"(G={job_.algorithm.num_generations}, loss {job_.algorithm.loss_type}, {job_.algorithm.importance_level} level, "
        f"beta {job_.algorithm.beta}); {job_.train.max_steps} steps of {job_.train.per_device_batch} completions; "
        f"data {job_.data.path}; output {out}",
        flush=True,
    )
    last = train(job_, out, device)
    print(f"done: reward {last.get('reward', float('nan')):.3f} at step {int(last.get('step', 0))}")
    print(f"  model:   {out / 'final'}  (AutoModelForCausalLM.from_pretrained)")
    print(f"  metrics: {out / 'metrics.jsonl'}")
    print(f"  samples: {out / 'samples.jsonl'}")
    return 0
