"""`gpufleet config`: the resolved job, where each value came from (table, YAML that behaves as it reads, JSON);
with `--explain [FIELD]` each field's documentation and choices. No torch import."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Collection, Mapping, Sequence

import yaml

from gpufleet.config.load import Resolved, dump_job, field_choices, load_job, portable
from gpufleet.config.problems import Source, format_value, render_problems, summary
from gpufleet.config.schema import SECTIONS, field_doc, field_paths
from gpufleet.errors import EXIT_USER_ERROR, UserError


def show_config(
    job: str | None,
    sets: Sequence[str],
    fmt: str,
    env: Mapping[str, str],
    explain: bool | str = False,
) -> int:
    """`gpufleet config`: the resolved job with the source of every value. `explain`: True for every
    field's documentation, or a field / section name for those fields only (then the job may be left out:
    the defaults, env and flags are shown)."""
    only = _explained(explain) if isinstance(explain, str) else None
    if job is None and not explain:
        raise UserError(
            "config needs a job file.",
            fix="gpufleet config JOB (or gpufleet config --explain FIELD for one field's documentation)",
        )
    r = load_job(job, sets, env)
    docs = bool(explain)
    if fmt == "json":
        print(json.dumps(render_json(r, docs, only), indent=2))
    elif fmt == "yaml":  # a file that works from any folder: user modules and flag paths made absolute
        resolved, notes = portable(r)
        print(render_yaml(resolved, notes, docs=docs, only=only))
    else:
        print(render_table(r, docs, only))
    if r.problems:
        print(render_problems(r.problems), file=sys.stderr)
        print(summary(r.problems) + " (values above fell back to a lower layer)", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _explained(name: str) -> set[str]:
    """The fields `--explain NAME` names: one field, or every field of a section; else a UserError with
    gpufleet's name for it (TRL's names included) or the nearest one."""
    from gpufleet.config.layers import unknown_name

    name = name.strip()
    if name in SECTIONS:
        return {p for p in field_paths() if p.startswith(name + ".")}
    if name in field_paths():
        return {name}
    p = unknown_name(name, Source("flag", f"--explain {name}"))
    suggestion = p.extra.get("suggestion")
    fix = (
        f"gpufleet config --explain {suggestion}" if suggestion else "name a field such as train.lr_scheduler"
    )
    raise UserError(f"--explain {name}: {p.why}", fix=fix)


def choices_text(path: str) -> str:
    """`Choices: a, b, c.` for a field with named choices (Literal), else ''."""
    words, other, nullable = field_choices(path)
    if not words:
        return ""
    tail = f", or {other}" if other else (", or null" if nullable else "")
    return f"Choices: {', '.join(words)}{tail}."


def explanation(path: str) -> str:
    """A field's documentation, with its choices."""
    return " ".join(x for x in (field_doc(path), choices_text(path)) if x)


def _rows(r: Resolved, only: Collection[str] | None):
    """(section, field, value) of the job, in file order, limited to `only` when given."""
    for section, fields in dump_job(r).items():
        for name, value in fields.items():
            if only is None or f"{section}.{name}" in only:
                yield section, name, value


def render_json(r: Resolved, docs: bool = False, only: Collection[str] | None = None) -> dict:
    out: dict[str, dict] = {}
    for section, name, value in _rows(r, only):
        path = f"{section}.{name}"
        entry: dict = {"value": value, "source": str(r.source(path))}
        if docs:
            entry["doc"] = field_doc(path)
            words = field_choices(path)[0]
            if words:
                entry["choices"] = words
        out.setdefault(section, {})[name] = entry
    return out


def render_yaml(
    r: Resolved,
    notes: Mapping[str, str] | None = None,
    *,
    docs: bool = False,
    only: Collection[str] | None = None,
) -> str:
    """A valid job file that behaves as it reads: the values a layer set (file, Slurm, env, flag) as YAML, each
    with its source; defaults and values derived from them (presets, micro_batch) only as comments, so
    that editing `algorithm.name` in the output re-derives its preset as it would in the original.
    `notes`: a comment per field added after its source; `docs`: each field's documentation as comment
    lines above it; `only`: these fields only."""
    notes = notes or {}
    lines = [
        f"# resolved by gpufleet config from {r.origin}" if r.origin else "# resolved by gpufleet config",
        "# '#   field: value' lines are defaults or derived values: uncomment one to pin it.",
    ]
    last = None
    for section, name, value in _rows(r, only):
        if section != last:
            lines.append(f"{section}:")
            last = section
        path = f"{section}.{name}"
        if docs:
            lines += [f"  # {line}" for line in textwrap.wrap(explanation(path), 96)]
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
        src = r.source(path)
        said = "; ".join(x for x in (str(src), notes.get(path)) if x)
        if src.kind in ("file", "slurm", "env", "flag"):
            lines.append(f"  {name}: {text}  # {said}")
        else:
            lines.append(f"  #   {name}: {text}  # {said}")
    return "\n".join(lines)


def render_table(r: Resolved, explain: bool = False, only: Collection[str] | None = None) -> str:
    rows = [(f"{s}.{f}", format_value(v), str(r.source(f"{s}.{f}"))) for s, f, v in _rows(r, only)]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = min(max(len(b) for _, b, _ in rows), 40)
    out = [f"{'field'.ljust(w0)}  {'value'.ljust(w1)}  source", "-" * (w0 + w1 + 12)]
    for a, b, c in rows:
        out.append(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}")
        if explain:
            out += [f"    {line}" for line in textwrap.wrap(explanation(a), 96)] + [""]
    return "\n".join(out)
