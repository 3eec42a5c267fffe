"""`gpufleet watch RUN_DIR [--once] [--interval S]`: a live terminal view of a run, running or finished.

    gpufleet watch runs/quickstart            # refreshes every second; Ctrl-C leaves
    gpufleet watch runs/quickstart --once     # print the view once (scripts, CI logs)

It reads only the run directory (metrics.jsonl, every node's devices file, warnings.jsonl, job.yaml), so it works
from another terminal, another machine on a shared file system, or after the run: step / max steps and
ETA; sparklines of reward, KL and completion length; per device (GPU utilisation and memory, or per
rank CPU% and resident memory) bars; per rank the last step time and its slowest phase; the last warning.
"""

from __future__ import annotations

import math
import time

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from gpufleet.monitor.metrics import fmt_time
from gpufleet.monitor.runfiles import Run, device_label, gpu_ranks, latest_by_node, load_run, max_steps
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


def value_range(values: list[float], width: int = 40) -> str:
    """`low .. high` of what `sparkline` draws (its lowest and highest block), so a flat-looking or a
    jumpy curve can be read: 0.49 .. 0.51 is not 0 .. 1."""
    vals = squeeze(values, width)
    return f"{min(vals):.4g} .. {max(vals):.4g}" if vals else "-"


def bar(fraction: float, width: int = 20) -> str:
    """`███████░░░░░░░░░░░░░` for a fraction in [0, 1]."""
    f = min(max(fraction, 0.0), 1.0)
    full = int(round(f * width))
    return "█" * full + "░" * (width - full)


def _header(run: Run) -> Text:
    last = run.metrics[-1] if run.metrics else {}
    step, total = int(last.get("step", 0)), max_steps(run)
    recent = [m["step_time"] for m in run.metrics[-10:] if "step_time" in m]
    per_step = sum(recent) / len(recent) if recent else math.nan
    done = (run.path / "final").exists() or (total is not None and step >= total)
    eta = "finished" if done else f"eta {fmt_time(per_step * ((total or step) - step))}"
    return Text(
        f"{run.name}  step {step}/{total or '?'}  {per_step:.2f}s/step  {eta}",
        style="bold",
    )


def _curves(run: Run) -> Table:
    t = Table(title="curves", title_justify="left", show_edge=False)
    t.add_column("metric")
    t.add_column("last", justify="right")
    t.add_column("history (whole run)")
    t.add_column("low .. high")
    for key, name in (("reward", "reward"), ("kl", "kl"), ("completions/mean_length", "length")):
        _, values = run.series(key)
        t.add_row(name, f"{values[-1]:.4g}" if values else "-", sparkline(values), value_range(values))
    return t


def _devices(run: Run) -> Table:
    """The newest sample of every node's devices (labels carry the node on a run over several)."""
    t = Table(title="devices", title_justify="left", show_edge=False)
    t.add_column("device")
    t.add_column("busy")
    t.add_column("memory")
    multi = run.several_nodes
    for rec in latest_by_node(run.devices):
        node = rec.get("node", 0)
        roles = {x["rank"]: x["role"] for x in rec.get("ranks", [])}
        for g in rec.get("gpus", []):
            who = gpu_ranks(g, roles)
            used, total = g.get("mem_used") or 0, g.get("mem_total") or 1
            t.add_row(
                f"{device_label('GPU', g['index'], node, multi)} {who}",
                f"{bar((g.get('util') or 0) / 100)} {g.get('util') or 0:>3}%",
                f"{bar(used / total)} {used / GIB:.1f}/{total / GIB:.1f} GiB",
            )
        if not rec.get("gpus"):
            for x in rec.get("ranks", []):
                t.add_row(
                    f"{device_label('rank', x['rank'], node, multi)} {x['role']}",
                    f"{bar(x['cpu_percent'] / 100)} {x['cpu_percent']:>5.0f}% cpu",
                    f"{x['rss'] / GIB:.2f} GiB rss",
                )
    return t


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
        t.add_row(str(r), f"{step:.2f}s", f"{top} {work[top]:.2f}s", f"{comm:.2f}s")
    return t


def render(run: Run) -> Group:
    """The whole view of a run as it is now."""
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
