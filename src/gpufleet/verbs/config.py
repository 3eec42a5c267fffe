"""`gpufleet config`: the resolved job, where each value came from (table, YAML that behaves as it reads, JSON).
No torch import."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Mapping, Sequence

import yaml

from gpufleet.config.load import Resolved, dump_job, load_job
from gpufleet.config.problems import format_value, render_problems, summary
from gpufleet.config.schema import SECTIONS, field_doc
from gpufleet.errors import EXIT_USER_ERROR


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
    """A valid job file that behaves as it reads: the values a layer set (file, Slurm, env, flag) as YAML, each
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
            if src.kind in ("file", "slurm", "env", "flag"):
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
