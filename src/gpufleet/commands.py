"""The `check` and `config` verbs: resolve, check, print. No torch import."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Mapping, Sequence

import yaml

from gpufleet.config.batch import batch_note
from gpufleet.config.load import Resolved, dump_job, load_job
from gpufleet.config.problems import Problem, format_value
from gpufleet.config.schema import SECTIONS, field_doc
from gpufleet.errors import EXIT_USER_ERROR
from gpufleet.text import plural


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
    from gpufleet.hardware import resolve_hardware
    from gpufleet.rules import run_checks

    hw = resolve_hardware(gpus, env)
    r = load_job(job, sets, env)
    if r.job.script.command and not r.problems:  # a `gpufleet launch` job: its own checks, nothing runs
        from gpufleet.launch.script import launch_command

        return launch_command(job, sets, gpus, env, [], dry_run=True)
    problems, ctx = run_checks(r, hw, env)
    print(f"gpufleet check {job}")
    print(f"  hardware: {hw.describe()}")
    print(f"  world:    {ctx.topo.describe()}; {plural(ctx.topo.world_size, 'process', 'processes')}")
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
    note = batch_note(r, ctx.topo.policy_ranks)
    if note:
        print(f"  {note}")
    if problems:
        print(render_problems(problems))
    print(summary(problems))
    return EXIT_USER_ERROR if any(p.severity == "error" for p in problems) else 0


def show_config(
    job: str, sets: Sequence[str], fmt: str, env: Mapping[str, str], explain: bool = False
) -> int:
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
        print(render_table(r, explain))
    if r.problems:
        print(render_problems(r.problems), file=sys.stderr)
        print(summary(r.problems) + " (values above fell back to a lower layer)", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def render_yaml(r: Resolved) -> str:
    """A valid job file that behaves as it reads: the values a layer set (file, env, flag) as YAML, each
    with its source; defaults and values derived from them (presets, micro_batch) only as comments, so
    that editing `algorithm.name` in the output re-derives its preset as it would in the original."""
    data = dump_job(r)
    lines = [
        f"# resolved by gpufleet config from {r.job_path}" if r.job_path else "# resolved by gpufleet config",
        "# '#   field: value' lines are defaults or derived values: uncomment one to pin it.",
    ]
    for section in SECTIONS:
        lines.append(f"{section}:")
        for name, value in data[section].items():
            text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
            text = text.removesuffix("\n...").removesuffix("...").strip()
            src = r.source(f"{section}.{name}")
            if src.kind in ("file", "env", "flag"):
                lines.append(f"  {name}: {text}  # {src}")
            else:
                lines.append(f"  #   {name}: {text}  # {src}")
    return "\n".join(lines)


def render_table(r: Resolved, explain: bool = False) -> str:
    data = dump_job(r)
    rows = [
        (f"{s}.{f}", format_value(v), str(r.source(f"{s}.{f}")))
        for s, fields in data.items()
        for f, v in fields.items()
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = min(max(len(b) for _, b, _ in rows), 40)
    out = [f"{'field'.ljust(w0)}  {'value'.ljust(w1)}  source", "-" * (w0 + w1 + 12)]
    for a, b, c in rows:
        out.append(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}")
        if explain:
            out += [f"    {line}" for line in textwrap.wrap(field_doc(a), 96)] + [""]
    return "\n".join(out)
