"""`gpufleet watch RUN_DIR [--once] [--interval S]`: a live terminal view of a run, running or finished.

    gpufleet watch runs/quickstart            # refreshes every second; Ctrl-C leaves
    gpufleet watch runs/quickstart --once     # print the view once (scripts, CI logs)

It reads only the run directory (metrics.jsonl, every node's devices file, warnings.jsonl, job.yaml; for
a `gpufleet launch`ed script launch.json and logs/), so it works from another terminal, another machine
on a shared file system, or after the run. A `train` run: step / max steps, s/step and ETA; sparklines of
reward, KL and completion length (and an agent run's env/* metrics); per device (GPU utilisation and
memory, or per rank CPU% and resident memory) bars, and each environment server's CPU% and memory; per
rank the last step time and its slowest phase; the last warning. A launched script: samples, samples/s,
progress and ETA from its progress lines, the command and recipe, the devices, each rank's last line.
A run that is over shows each device's peak over the run instead of the sample taken after the exit.
"""

from __future__ import annotations

import math
import time

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from gpufleet.monitor.launched import Launched
from gpufleet.monitor.metrics import fmt_time
from gpufleet.monitor.runfiles import (
    Run,
    device_label,
    ended,
    env_server_series,
    finished,
    gpu_ranks,
    latest_by_node,
    load_run,
    max_steps,
    peaks,
)
from gpufleet.monitor.timing import PHASES

SPARKS = "▁▂▃▄▅▆▇█"
GIB = 1024**3


def squeeze(values: list[float], width: int) -> list[float]:
    """The finite values, the whole run in at most `width` points: the means of `width` equal runs of
    consecutive values when there are more (the history from step 1, not only its last `width` steps)."""
    vals = [v for v in values if math.isfinite(v)]
    n = len(vals)
    if n <= width:
        return vals
    cuts = [i * n // width for i in range(width + 1)]
    return [sum(vals[a:b]) / (b - a) for a, b in zip(cuts, cuts[1:], strict=False)]


def sparkline(values: list[float], width: int = 40) -> str:
    """The whole series (`squeeze`d to `width` points) as block characters, scaled between its min and
    max (`value_range` says what those are)."""
    vals = squeeze(values, width)
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(SPARKS[min(int((v - lo) / span * (len(SPARKS) - 1) + 0.5), len(SPARKS) - 1)] for v in vals)


def value_range(values: list[float]) -> str:
    """`low .. high` of the whole series (every finite value, the last one included; the sparkline's
    blocks are means of runs of values), so a flat-looking or a jumpy curve can be read: 0.49 .. 0.51 is
    not 0 .. 1."""
    vals = [v for v in values if math.isfinite(v)]
    return f"{min(vals):.4g} .. {max(vals):.4g}" if vals else "-"


def bar(fraction: float, width: int = 20) -> str:
    """`███████░░░░░░░░░░░░░` for a fraction in [0, 1]."""
    f = min(max(fraction, 0.0), 1.0)
    full = int(round(f * width))
    return "█" * full + "░" * (width - full)


def is_over(run: Run) -> bool:
    """Finished, failed, or its processes gone (the sampler's newest record finds no rank alive)."""
    failed = run.launched is not None and run.launched.failed()
    return bool(finished(run) or failed or ended(run.devices))


def _header(run: Run) -> Text:
    if run.launched is not None:
        return _launched_header(run, run.launched)
    last = run.metrics[-1] if run.metrics else {}
    step, total = int(last.get("step", 0)), max_steps(run)
    recent = [m["step_time"] for m in run.metrics[-10:] if "step_time" in m]
    per_step = sum(recent) / len(recent) if recent else math.nan
    if finished(run):
        eta = "finished"
    elif ended(run.devices):
        eta = "ended before its last step (no final model; see logs/)"
    else:
        eta = f"eta {fmt_time(per_step * ((total or step) - step))}"
    return Text(f"{run.name}  step {step}/{total or '?'}  {per_step:.2f}s/step  {eta}", style="bold")


def _launched_header(run: Run, ln: Launched) -> Text:
    """samples (of the recipe's total), samples/s over the newest progress lines, ETA or how it ended."""
    total, rate = ln.total_samples, ln.rate()
    if not ln.points:
        if failed := ln.failed(last_line=True):
            said = f"failed before its first progress line: {failed}"
        elif ended(run.devices):
            said = "ended before its first progress line (see logs/rank<R>.log)"
        else:
            said = (
                "no progress lines yet (rank 0 prints them with gpufleet.progress.report(samples), or set "
                "script.progress_regex)"
            )
        return Text(f"{run.name}  launched script  {said}", style="bold")
    done = f"samples {ln.samples}" + (f"/{total} ({ln.samples / total:.0%})" if total else "")
    speed = f"{rate:.4g} samples/s" if rate is not None else "? samples/s"
    failed = ln.failed(last_line=True)
    if failed:
        end = f"failed: {failed}"
    elif finished(run) or ended(run.devices):  # (a script without a recipe: its ranks have exited)
        end = "finished"
    else:
        eta = ln.eta_s()
        end = f"eta {fmt_time(eta)}" if eta is not None else "eta ? (launch.json gives no max steps)"
    return Text(f"{run.name}  launched script  {done}  {speed}  {end}", style="bold")


def _add(t: Table, *cells: str) -> None:
    """One row of plain text: a log line, a command, a path or a metric's name is shown as it is, never
    read as rich markup (`[/tmp/ckpt]` is not a closing tag, `[bold]x` is not bold x)."""
    t.add_row(*(Text(c) for c in cells))


def _row(t: Table, name: str, values: list[float]) -> None:
    _add(t, name, f"{values[-1]:.4g}" if values else "-", sparkline(values), value_range(values))


def _curves(run: Run) -> Table:
    t = Table(title="curves", title_justify="left", show_edge=False)
    t.add_column("metric")
    t.add_column("last", justify="right")
    t.add_column("history (whole run)")
    t.add_column("low .. high")
    if run.launched is not None:
        _row(t, "samples/s", [rate for _, rate in run.launched.rates()])
        return t
    for key, name in (("reward", "reward"), ("kl", "kl"), ("completions/mean_length", "length")):
        _row(t, name, run.series(key)[1])
    for key in run.agent_keys():  # an agent run: what the environment and the tools say
        _row(t, key, run.series(key)[1])
    return t


def _devices(run: Run) -> Table:
    """The newest sample of every node's devices (labels carry the node on a run over several); once
    the run has ended, each device's peak over the run."""
    over = is_over(run)
    top = peaks(run.devices) if over else {}
    t = Table(
        title="devices" + (" (the run is over: peaks over the run)" if over else ""),
        title_justify="left",
        show_edge=False,
    )
    t.add_column("device")
    t.add_column("busy")
    t.add_column("memory")
    multi = run.several_nodes
    for rec in latest_by_node(run.devices):
        node = rec.get("node", 0)
        roles = {x["rank"]: x["role"] for x in rec.get("ranks", [])}
        for g in rec.get("gpus", []):
            util, used = g.get("util") or 0, g.get("mem_used") or 0
            util, used = top.get((node, "gpu", g["index"]), (util, used)) if over else (util, used)
            total = g.get("mem_total") or 1
            _add(
                t,
                f"{device_label('GPU', g['index'], node, multi)} {gpu_ranks(g, roles)}",
                f"{bar(util / 100)} {util:>3.0f}%",
                f"{bar(used / total)} {used / GIB:.1f}/{total / GIB:.1f} GiB",
            )
        for x in rec.get("ranks", []) if not rec.get("gpus") else []:
            cpu, rss = top.get((node, "rank", x["rank"]), (0, 0)) if over else (x["cpu_percent"], x["rss"])
            _add(
                t,
                f"{device_label('rank', x['rank'], node, multi)} {x['role']}",
                f"{bar(cpu / 100)} {cpu:>5.0f}% cpu",
                f"{rss / GIB:.2f} GiB rss",
            )
    _env_servers(t, run, over)
    return t


def _env_servers(t: Table, run: Run, over: bool) -> None:
    """An agent run's environment servers: CPU% and memory now (their peaks once the run has ended)."""
    for label, points in env_server_series(run.devices).items():
        cpu, rss = (max(p[1] for p in points), max(p[2] for p in points)) if over else points[-1][1:]
        _add(t, label, f"{bar(cpu / 100)} {cpu:>5.0f}% cpu", f"{rss / GIB:.2f} GiB rss")


def _ranks(run: Run) -> Table:
    t = Table(title="ranks (last step)", title_justify="left", show_edge=False)
    t.add_column("rank")
    t.add_column("step time", justify="right")
    t.add_column("slowest phase")
    t.add_column("waiting (comm)", justify="right")
    last = run.metrics[-1] if run.metrics else {}
    many = len(run.ranks) > 1
    for r in run.ranks if last else []:
        sfx = f"/rank{r}" if many else ""
        step = last.get(f"step_time{sfx}", last.get("step_time", 0.0))
        work = {p: last.get(f"timing/{p}{sfx}", 0.0) for p in PHASES if p not in ("comm", "other")}
        top = max(work, key=work.get)
        comm = last.get(f"timing/comm{sfx}", 0.0)
        _add(t, str(r), f"{step:.2f}s", f"{top} {work[top]:.2f}s", f"{comm:.2f}s")
    return t


def _launch(ln: Launched) -> Table:
    """The resolved launch (launch.json): command, processes, recipe, the GPUFLEET_* variables."""
    t = Table(title="launch", title_justify="left", show_edge=False, show_header=False)
    t.add_column("what")
    t.add_column("value")
    if not ln.launch:
        _add(t, "launch.json", "not in the run folder (written by gpufleet launch)")
        return t
    _add(t, "command", ln.command())
    _add(t, "processes", f"{ln.launch.get('nproc', '?')} per node x {ln.launch.get('nnodes', 1)} node(s)")
    for name, ref, now in ln.recipe_rows():
        _add(t, name, f"{now}  (reference {ref})" if ref != "-" else now)
    env = ln.launch.get("env") or {}
    ours = {k: v for k, v in env.items() if k.startswith("GPUFLEET_")} if isinstance(env, dict) else {}
    if ours:  # the values the script reads (the report lists every variable set)
        _add(t, "env", " ".join(f"{k}={v}" for k, v in ours.items()))
    return t


def _rank_lines(ln: Launched, width: int = 100) -> Table:
    """Each rank's last line of output (logs/rank<R>.log)."""
    t = Table(title="ranks (last line)", title_justify="left", show_edge=False)
    t.add_column("rank")
    t.add_column("last line")
    for rank, line in ln.last_lines.items():
        line = line or "(no output yet)"
        _add(t, str(rank), line if len(line) <= width else line[: width - 1] + "…")
    return t


def render(run: Run) -> Group:
    """The whole view of a run as it is now."""
    if run.launched is not None:
        ln = run.launched
        return Group(_header(run), _curves(run), _launch(ln), _devices(run), _rank_lines(ln))
    warning = run.warnings[-1] if run.warnings else None
    last = (
        Text(f"warning (step {warning['step']}): {warning['text']}", style="yellow") if warning else Text("")
    )
    return Group(_header(run), _curves(run), _devices(run), _ranks(run), last)


def watch(run_dir: str, *, once: bool = False, interval: float = 1.0) -> int:
    """Print the view once, or refresh it until Ctrl-C."""
    console = Console()
    if once:
        console.print(render(load_run(run_dir)))
        return 0
    from rich.live import Live

    with Live(render(load_run(run_dir)), console=console, screen=False, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(load_run(run_dir)), refresh=True)
        except KeyboardInterrupt:
            return 0
