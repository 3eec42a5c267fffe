"""`gpufleet report RUN_DIR [RUN_DIR ...] [--out DIR]`: one self-contained HTML page (the figures inlined
as data: URIs; also saved beside it as PNGs) about one run, or several runs overlaid (e.g. 1 vs 2 ranks).

    gpufleet report runs/quickstart                        # runs/quickstart/report/index.html
    gpufleet report runs/one-rank runs/two-ranks --out cmp # cmp/index.html, the runs' curves overlaid

Sections: a summary per run; curves (reward, KL, length, entropy, step time, tokens/s); an agent run's
environment (its env/* metrics, and each environment server's CPU% and memory); where the step's time
goes (mean per phase, per rank); devices over time (GPU utilisation and memory, or per-rank CPU% and
RSS) and each device's mean and peak, on every node (`node1:gpu0` on a run over several); plan vs
measured peak memory per rank; the warnings the run printed; each run's resolved job with the source of
every value (its job.yaml). A `gpufleet launch`ed script instead has its progress (samples and samples/s
over time, from its progress lines), its resolved launch (command, processes, recipe, GPUFLEET_*
variables: launch.json) and each rank's last line. No script, no external resource: it opens offline.
"""

from __future__ import annotations

import base64
import html
import statistics
from collections.abc import Sequence
from pathlib import Path

from gpufleet.monitor.launched import Launched
from gpufleet.monitor.runfiles import Run, device_series, ended_early, env_server_series, load_run
from gpufleet.paths import user_path

GIB = 1024**3
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ddd; padding: .25em .6em; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; } pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .85em; }
.warn { color: #8a4b00; } .muted { color: #777; }
"""


def write_report(run_dirs: Sequence[str], out: str | None = None) -> Path:
    """Write the report; returns the path of index.html."""
    from gpufleet.monitor import figures

    runs = [load_run(d) for d in run_dirs]
    folder = user_path(out) if out else runs[0].path / "report"
    folder.mkdir(parents=True, exist_ok=True)
    images: list[tuple[str, str, Path]] = []
    for name, title, draw in (
        ("curves.png", "Curves", figures.curves),
        ("progress.png", "Progress of the launched script", figures.progress),
        ("environment.png", "Environment", figures.environment),
        ("timing.png", "Where the step's time goes", figures.timing_breakdown),
        ("devices.png", "Devices over time", figures.devices),
    ):
        if draw(runs, folder / name):
            images.append((name, title, folder / name))
    page = _page(runs, images)
    index = folder / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" id="fig-{path.stem}">'


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = []
    for row in rows:
        cells = []
        for v in row:
            num = isinstance(v, float | int)
            text = f"{v:.3g}" if isinstance(v, float) else str(v)
            cells.append(f'<td class="num">{text}</td>' if num else f"<td>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{th}</tr>{''.join(body)}</table>"


def _summary(run: Run) -> list[object]:
    m = run.metrics
    last = m[-1] if m else {}
    mean = lambda k: statistics.fmean(x[k] for x in m if k in x) if any(k in x for x in m) else "-"  # noqa: E731
    if run.launched is not None:  # a launched script: its progress lines, no metrics
        ln = run.launched
        total = ln.total_samples
        rate = ln.rate()
        done = f"{ln.samples} samples" + (f" of {total}" if total else "")
        return [run.name, done, "-", "-", "-" if rate is None else f"{rate:.4g} samples/s", _hardware(run)]
    return [
        run.name,
        int(last.get("step", 0)),
        float(last.get("reward", float("nan"))) if last else "-",
        mean("step_time"),
        "-" if mean("tokens_per_s") == "-" else f"{mean('tokens_per_s'):.4g} tokens/s",
        run.plan.get("hardware") or _hardware(run),
    ]


def _hardware(run: Run) -> str:
    """What the devices files saw: the GPUs' names, or the CPU and its ranks."""
    gpus = {
        (rec.get("node", 0), g["index"]): g.get("name", "GPU")
        for rec in run.devices
        for g in rec.get("gpus", [])
    }
    if gpus:
        names = sorted(set(gpus.values()))
        return f"{len(gpus)} x {' / '.join(names)}"
    ranks = {(rec.get("node", 0), x["rank"]) for rec in run.devices for x in rec.get("ranks", [])}
    return f"CPU, {len(ranks)} rank{'s' * (len(ranks) != 1)}" if ranks else "-"


def env_rows(run: Run) -> list[list[object]]:
    """Per environment server: mean CPU %, peak memory GiB, samples."""
    return [
        [run.name, label, statistics.fmean(p[1] for p in pts), max(p[2] for p in pts) / GIB, len(pts)]
        for label, pts in env_server_series(run.devices).items()
    ]


def _launched(run: Run, ln: Launched) -> list[str]:
    """A launched script's resolved launch (launch.json), how it ended, and each rank's last line."""
    parts = [f"<h2 id='launch-{html.escape(run.name)}'>Launched script: {html.escape(run.name)}</h2>"]
    if ln.launch:
        started = ln.launch.get("started")
        rows = [
            ["command", ln.command()],
            ["processes", f"{ln.launch.get('nproc', '?')} per node x {ln.launch.get('nnodes', 1)} node(s)"],
        ]
        rows += [["started", str(started)]] if started is not None else []
        env = ln.launch.get("env") or {}
        rows += [[k, str(v)] for k, v in env.items()] if isinstance(env, dict) else []
        parts.append(_table(["", ""], rows))
        if ln.recipe_rows():
            parts.append("<h3>Recipe</h3>" + _table(["", "reference", "now"], ln.recipe_rows()))
    else:
        parts.append("<p class='muted'>no launch.json in this run folder (gpufleet launch writes it)</p>")
    failed = ln.failed(last_line=True)
    if failed:
        parts.append(f"<p class='warn'>failed: {html.escape(failed)}</p>")
    parts.append("<h3>Each rank's last line</h3>")
    parts.append(
        _table(["rank", "last line (logs/rank<R>.log)"], [[str(r), x] for r, x in ln.last_lines.items()])
    )
    return parts


def device_rows(run: Run) -> list[list[object]]:
    """Per device of every node (per rank on a CPU-only node): mean busy %, peak memory, samples."""
    return [
        [
            run.name,
            label,
            statistics.fmean(p[1] for p in points),
            max(p[2] for p in points) / GIB,
            len(points),
        ]
        for label, points in device_series(run.devices).items()
    ]


def plan_rows(run: Run) -> list[list[object]]:
    """Per rank of the plan: role, planned GiB, measured peak GiB, measured / planned."""
    last = run.metrics[-1] if run.metrics else {}
    many = len(run.ranks) > 1
    rows: list[list[object]] = []
    for r in run.plan.get("ranks", []):
        i = r["local_rank"]
        peak = last.get(f"memory/peak_gib/rank{i}" if many else "memory/peak_gib") if i in run.ranks else None
        planned = r["bytes"] / GIB
        measured = "-" if peak is None else float(peak)
        ratio = "-" if peak is None or not planned else float(peak) / planned
        rows.append([run.name, i, r["role"], r["device"], planned, measured, ratio])
    return rows


def _page(runs: list[Run], images: list[tuple[str, str, Path]]) -> str:
    names = ", ".join(r.name for r in runs)
    parts = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>gpufleet report: {html.escape(names)}"
        f"</title><style>{STYLE}</style></head><body>",
        f"<h1>gpufleet report: {html.escape(names)}</h1>",
        "<h2 id='summary'>Summary</h2>",
        _table(
            ["run", "steps", "last reward", "mean step time (s)", "throughput", "hardware"],
            [_summary(r) for r in runs],
        ),
    ]
    for r in runs:
        if r.launched is not None:
            parts += _launched(r, r.launched)
        elif early := ended_early(r):
            parts.append(
                f"<p class='warn'>{html.escape(r.name)} ended before its last step ({early}; no final model; "
                "see its logs/)</p>"
            )
    for name, title, path in images:
        parts += [f"<h2>{html.escape(title)}</h2>", _img(path, title), f"<p class='muted'>{name}</p>"]
    devices = [row for r in runs for row in device_rows(r)]
    if devices:
        parts.append("<h2 id='devices'>Devices</h2>")
        parts.append(_table(["run", "device", "mean busy %", "peak memory GiB", "samples"], devices))
    servers = [row for r in runs for row in env_rows(r)]
    if servers:
        parts.append("<h2 id='env-servers'>Environment servers</h2>")
        parts.append(
            _table(["run", "server", "mean CPU % (100 = one core)", "peak RSS GiB", "samples"], servers)
        )
    rows = [row for r in runs for row in plan_rows(r)]
    if all(r.launched is not None for r in runs):  # launched scripts have no plan: skip to the warnings
        return _tail(runs, parts)
    parts.append("<h2 id='plan'>Plan vs measured peak memory</h2>")
    parts.append(
        _table(["run", "rank", "role", "device", "planned GiB", "measured GiB", "measured / planned"], rows)
        if rows
        else "<p class='muted'>no plan.json in these runs (written by gpufleet train)</p>"
    )
    parts.append(
        "<p class='muted'>measured: CUDA max allocated on a GPU (the plan also counts the CUDA context), "
        "the process's peak RSS on the CPU.</p>"
    )
    return _tail(runs, parts)


def _tail(runs: list[Run], parts: list[str]) -> str:
    """The warnings and each trained run's resolved job; the page's end."""
    said = [(r.name, w) for r in runs for w in r.warnings]
    parts.append("<h2 id='warnings'>Warnings</h2>")
    parts.append(
        "".join(
            f"<p class='warn'>{html.escape(n)} step {w['step']}: {html.escape(w['text'])}</p>"
            for n, w in said
        )
        or "<p class='muted'>none</p>"
    )
    for r in runs:
        if r.launched is not None:  # its resolved launch is above; a launched script has no job.yaml
            continue
        parts.append(f"<h2>Resolved job: {html.escape(r.name)}</h2>")
        parts.append(f"<pre>{html.escape(r.job_yaml or '(no job.yaml)')}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
