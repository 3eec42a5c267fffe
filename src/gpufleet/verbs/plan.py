"""`gpufleet plan JOB [--set ...] [--gpus SPEC] [--format table|json]`: bytes per device before launch.

    gpufleet plan examples/gspo-3gpu.yaml --gpus 3x16GB        # the note-001 layout, per-GPU totals
    gpufleet plan job.yaml --gpus 1x24GB --format json         # the same, machine-readable

Prints which device holds which role, the predicted bytes per device by component (weights, grads,
optimizer, activations, KV cache, scoring, other), the strategy and why, and the largest
per_device_batch / num_generations / max_completion_length that fit. Exit 0 when the job fits, 2 when
it does not (or cannot be laid out), with fixes that were each planned again and fit with >= 10% free.
A colocated job on 2+ GPUs also gets up to 3 layouts with the rollout on devices of its own, one step
ahead (plan/split.py), each planned, with its flags and expected time per completion.
No torch import: the model's config.json is all it reads.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence

from gpufleet.config.load import Resolved, load_job
from gpufleet.config.problems import Problem
from gpufleet.errors import EXIT_USER_ERROR, UserError
from gpufleet.hardware import Hardware, resolve_hardware
from gpufleet.plan.change import flags
from gpufleet.plan.fixes import Fix, find_fixes, find_layouts
from gpufleet.plan.largest import Largest, largest_that_fits
from gpufleet.plan.loads import HEADROOM, Plan
from gpufleet.plan.memory import gib
from gpufleet.plan.search import make_plan
from gpufleet.plan.shape import Models, load_models
from gpufleet.plan.split import find_splits
from gpufleet.text import plural

COLUMNS = ("weights", "grads", "optimizer", "activations", "kv cache", "scoring", "other")


def plan_command(job: str, sets: Sequence[str], gpus: str, fmt: str, env: Mapping[str, str]) -> int:
    """`gpufleet plan`: print the plan; 0 when it fits, 2 when it does not (with verified fixes)."""
    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r} is not a plan format.", fix="use --format table or --format json")
    try:
        hw = resolve_hardware(gpus, env)
        r = load_job(job, list(sets), env)
        models = load_models(r, env)
        plan, problems = make_plan(r, hw, env, models)
    except UserError as e:
        print(f"gpufleet: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    value_errors = [p for p in r.problems if p.severity == "error"]
    fixes: list[Fix] = []
    largest: list[Largest] = []
    if plan is None:
        fixes = find_layouts(r, hw, env, models)
    elif not plan.comfortable:
        fixes = find_fixes(r, hw, env, models)
    if plan is not None and plan.comfortable:
        largest = largest_that_fits(r, hw, env, models)
    splits = find_splits(r, hw, env, models) if plan is not None else []
    code = EXIT_USER_ERROR if plan is None or not plan.fits or value_errors else 0
    if fmt == "json":
        print(json.dumps(_as_json(job, hw, plan, problems, r, fixes, largest, code, splits), indent=2))
    else:
        print(render_table(job, hw, r, plan, problems + value_errors, fixes, largest, models, splits))
    return code


def _as_json(job, hw, plan, problems, r, fixes, largest, code, splits) -> dict:
    return {
        "job": job,
        "hardware": hw.describe(),
        "exit_code": code,
        "plan": plan.to_dict() if plan else None,
        "problems": [
            {"severity": p.severity, "field": p.field, "why": p.why, "fix": p.fix}
            for p in problems + r.problems
        ],
        "fixes": [f.to_dict() | {"command": f.command()} for f in fixes],
        "largest_that_fits": [x.to_dict() for x in largest],
        "rollout_splits": [f.to_dict() | {"command": f.command()} for f in splits],
        "notes": list(plan.models.notes) if plan else [],
    }


def _row(cells: Sequence[str], widths: Sequence[int], right_from: int) -> str:
    out = []
    for i, (c, w) in enumerate(zip(cells, widths, strict=True)):
        out.append(c.rjust(w) if i >= right_from else c.ljust(w))
    return "  ".join(out).rstrip()


def device_table(plan: Plan) -> str:
    """The per-device table: roles, bytes by component (GiB), total / capacity, free, peak phase."""
    head = ["device", "roles", *COLUMNS, "total / capacity GiB", "free", "peak"]
    rows = []
    for d in plan.devices:
        vals = [
            d.weights,
            d.grads,
            d.optimizer,
            d.phase("train"),
            d.phase("rollout"),
            d.phase("scoring"),
            d.other,
        ]
        peaks = ",".join(dict.fromkeys(p.peak_phase for p in d.processes))
        rows.append(
            [
                d.label,
                " | ".join(d.roles),
                *[gib(v) if v else "-" for v in vals],
                f"{gib(d.total)} / {gib(d.capacity)}",
                f"{d.headroom:.0%}",
                peaks,
            ]
        )
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    lines = [_row(head, widths, 2), "  ".join("-" * w for w in widths)]
    lines += [_row(r, widths, 2) for r in rows]
    return "\n".join(lines)


def render_table(
    job: str,
    hw: Hardware,
    r: Resolved,
    plan: Plan | None,
    problems: list[Problem],
    fixes: list[Fix],
    largest: list[Largest],
    models: Models,
    splits: Sequence[Fix] = (),
) -> str:
    from gpufleet.config.problems import render_problems

    out = _head_lines(job, hw, r, models)
    shown = [p for p in problems if p.severity == "error" or plan is None]
    if plan is None:
        out += ["", render_problems(shown) if shown else "the job cannot be laid out on this hardware.", ""]
        if fixes:
            out.append("layouts that fit this hardware (each planned; re-run plan with one):")
            out += _fix_lines(fixes)
        else:
            out.append("no layout on this hardware fits with the job's other values.")
        return "\n".join(out)
    out += [f"  layout:   {plan.describe_strategy()}", "", device_table(plan), LEGEND]
    out += [host_line(plan), "", "why:"] if plan.host else ["", "why:"]
    out += [f"  - {w}" for w in plan.why]
    out += [f"  - note: {note}" for note in plan.models.notes]
    if plan.changes:
        out.append(f"  - the planner's choice, to make it explicit: {flags(plan.changes)}")
    if shown:
        out += ["", render_problems(shown)]
    out += [
        "",
        _verdict(plan) + (f" {plan.models.reward_said}." if plan.models.reward_said else ""),
    ]
    if fixes:
        out.append("fixes (each planned again, >= 10% free on every device; re-run plan with one):")
        out += _fix_lines(fixes)
    elif not plan.comfortable:
        out.append("no fix found on GPUs of this kind: use GPUs with more memory or a smaller model.")
    if splits:
        out += ["", *split_lines(splits, r)]
    if largest:
        out += ["", f"largest that fits ({HEADROOM:.0%} free on every device, the others held):"]
        w = max(len(x.field) for x in largest)
        for x in largest:
            value = "nothing fits" if x.largest is None else str(x.largest)
            out.append(f"  {x.field.ljust(w)}  {str(x.current).rjust(6)} -> {value.ljust(8)} ({x.note})")
    return "\n".join(out)


LEGEND = (
    "  total = weights + optimizer + other + the largest phase with the grads it holds; the phases of a step "
    "follow each other and free their memory, the grads are freed after each optimizer step (rollout and "
    "scoring run without them; one micro-batch's backward makes them as it frees its activations):\n"
    "    activations = training (saved activations, autocast weight copies, logits, backward working set); "
    "kv cache = rollout (KV cache, fast decoder's fused weights, prefill / sampler);\n"
    "    scoring = reference / reward forward; optimizer step = AdamW's temporaries (FSDP). "
    "grads include DDP's buckets; other = overhead per process, batch tensors, FSDP's gathered layers "
    "(and, with offload, their shards staged on the GPU); scoring includes a sharded reference's gathered layers"
)


def _head_lines(job: str, hw: Hardware, r: Resolved, models: Models) -> list[str]:
    """`gpufleet plan JOB`, the hardware, the model and the job's sizes."""
    jb = r.job
    out = [f"gpufleet plan {job}", f"  hardware: {hw.describe()}"]
    pol = models.policy
    if pol is not None:
        out.append(
            f"  model:    {pol.path}: {pol.arch.model_type}, {pol.params.total / 1e6:,.1f}M parameters "
            f"(config.json from {pol.source})"
        )
    t, ro, a = jb.train, jb.rollout, jb.algorithm
    after = (
        f"episode {jb.completion_tokens()} (env {jb.env.name}: {jb.env.max_turns} turns)"
        if jb.env.name
        else f"completion {ro.max_completion_length}"
    )
    out.append(
        f"  job:      {a.name}, G={a.num_generations}, beta {a.beta}; per_device_batch {t.per_device_batch}, "
        f"micro-batch {t.micro_batch}, steps_per_generation {t.steps_per_generation}; "
        f"prompt {ro.max_prompt_length} + {after} tokens; precision {t.precision}, "
        f"model.dtype {jb.model.dtype}"
    )
    return out


def host_line(plan: Plan) -> str:
    """`host RAM per node: 152.3 of 256.00 GiB (stated): offloaded 140.3, loading 122.0 (the larger
    counts) + overhead 12.00 (4 processes x 3)`."""
    h = plan.host
    if h is None:
        return ""
    return (
        f"  host RAM per node: {gib(h.total)} of {gib(h.capacity)} GiB ({h.where()}): offloaded {gib(h.offloaded)}, "
        f"loading the models {gib(h.loading)} (the larger counts) + overhead {gib(h.overhead)} "
        f"({plural(h.processes, 'process')})"
    )


def _verdict(plan: Plan) -> str:
    """fits / fits, but tight / does not fit, with the devices (or the host RAM) that say so."""
    h = plan.host
    if h is not None and not h.comfortable and all(d.comfortable for d in plan.devices):
        state = "does not fit" if not h.fits else "fits, but tight"
        return (
            f"{state}: the host RAM of each node needs {gib(h.total)} of {gib(h.capacity)} GiB "
            f"(keep >= {HEADROOM:.0%} free) for {h.what()}."
        )
    tight = plan.tightest
    where = "cpu" if tight.index is None else f"device {tight.label}"
    if plan.comfortable:
        return (
            f"fits: every device keeps >= {HEADROOM:.0%} free (tightest: {where}, {gib(tight.total)} of "
            f"{gib(tight.capacity)} GiB, {tight.headroom:.0%} free)."
        )
    if plan.fits:
        return (
            f"fits, but tight: {where} keeps only {tight.headroom:.0%} free (< {HEADROOM:.0%}); "
            "allocator fragmentation may still run out of memory."
        )
    over = [d for d in plan.devices if not d.fits]
    needs = (
        f"{'cpu' if d.index is None else 'device ' + d.label} needs {gib(d.total)} GiB of {gib(d.capacity)}"
        for d in over
    )
    return "does not fit: " + "; ".join(needs) + "."


def devices_summary(plan: Plan, roles: bool = False) -> str:
    """`device 0: 7.95 / 16.00 GiB (50% free); devices 1-10: ...`: equal devices grouped. `roles`: each
    with what runs there (`devices 0-1: policy 9.21 / 24.00 GiB (62% free) each; device 2: rollout ...`)."""
    groups: list[tuple[list[str], str]] = []
    for d in plan.devices:
        text = f"{gib(d.total)} / {gib(d.capacity)} GiB ({d.headroom:.0%} free)"
        if roles:
            text = f"{' | '.join(dict.fromkeys(re.sub(r' rank [0-9]+|^scorer: ', '', x) for x in d.roles))} {text}"
        if groups and groups[-1][1] == text:
            groups[-1][0].append(d.label)
        else:
            groups.append(([d.label], text))
    parts = []
    for labels, text in groups:
        if labels == ["cpu"]:
            parts.append(f"cpu: {text}")
        elif len(labels) == 1:
            parts.append(f"device {labels[0]}: {text}")
        else:
            parts.append(f"devices {labels[0]}-{labels[-1]}: {text} each")
    return "; ".join(parts)


def _fix_lines(fixes: list[Fix]) -> list[str]:
    lines = []
    for i, f in enumerate(fixes, 1):
        lines.append(f"  {i}. {f.kind}: {f.command()}")
        host = f.plan.host
        extra = f"; host {gib(host.total)} / {gib(host.capacity)} GiB" if host and host.checked else ""
        lines.append(f"     -> {devices_summary(f.plan)}{extra}; ~{f.cost:.2g}x the time per completion")
    return lines


def split_lines(splits: Sequence[Fix], r: Resolved) -> list[str]:
    """The rollout splits (plan/split.py): one line each with its flags, one with its devices and the
    expected time, then the assumption behind that estimate."""
    g = splits[0].extra["generation_share"]
    lines = [
        "rollout on its own devices, one step ahead (rollout.async_steps 1; each planned, >= 10% free on every "
        "device; re-run plan with one):"
    ]
    for i, f in enumerate(splits, 1):
        lines.append(f"  {i}. {f.kind}: {f.command()}")
        lines.append(f"     -> {devices_summary(f.plan, roles=True)}; ~{f.cost:.2g}x the time per completion")
    lines.append(
        f"  estimated from the job's shape, not measured: sampling is ~{g:.0%} of its step now; split, a step "
        "takes the longer of sampling (a rollout rank samples the rows of its policy ranks at once) and training "
        "+ scoring, not their sum (the weight push not counted); the samples are one optimizer step stale, "
        + (
            "weighted by the sampler's ratio (algorithm.importance_sampling_correction)"
            if r.job.algorithm.importance_sampling_correction
            else "uncorrected (algorithm.importance_sampling_correction is off)"
        )
    )
    return lines
