"""The report's figures (matplotlib, Agg: no display needed), each saved as a PNG; several runs overlaid.

Each function takes the runs (monitor/runfiles.py) and a path, draws, saves, and returns whether it
drew anything (a run without devices.jsonl has no device figure).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
# Labels are the user's text (run folder names, metric names): 'run$\q$' is a name, not TeX (mathtext would
# raise on it). The report draws no formula of its own.
matplotlib.rcParams["text.parse_math"] = False
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from gpufleet.monitor.runfiles import Run, device_series, env_server_series  # noqa: E402
from gpufleet.monitor.timing import PHASES  # noqa: E402

CURVES = (
    ("reward", "reward"),
    ("kl", "KL"),
    ("completions/mean_length", "completion length"),
    ("entropy", "entropy"),
    ("step_time", "step time (s)"),
    ("tokens_per_s", "tokens / s"),
)
GIB = 1024**3


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def curves(runs: list[Run], path: Path) -> bool:
    """Reward, KL, length, entropy, step time, tokens/s against the step; one line per run."""
    if not any(r.metrics for r in runs):
        return False
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, CURVES, strict=True):
        for run in runs:
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, label=run.name, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    _save(fig, path)
    return True


def timing_breakdown(runs: list[Run], path: Path) -> bool:
    """Mean seconds per step in each phase, one stacked bar per run and rank (rank 0 adds up to step_time)."""
    bars: list[tuple[str, list[float]]] = []
    for run in runs:
        many = len(run.ranks) > 1
        for r in run.ranks:
            suffix = f"/rank{r}" if many else ""
            means = []
            for ph in PHASES:
                _, v = run.series(f"timing/{ph}{suffix}")
                means.append(sum(v) / len(v) if v else 0.0)
            if any(means):
                bars.append((f"{run.name} rank {r}" if many else run.name, means))
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(bars) + 1.6))
    left = [0.0] * len(bars)
    for i, ph in enumerate(PHASES):
        widths = [b[1][i] for b in bars]
        ax.barh([b[0] for b in bars], widths, left=left, label=ph)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds per step (mean)")
    ax.invert_yaxis()
    ax.legend(ncol=len(PHASES), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    _save(fig, path)
    return True


def devices(runs: list[Run], path: Path) -> bool:
    """Per GPU utilisation and memory over time (per rank CPU% and RSS on a CPU-only run)."""
    with_samples = [r for r in runs if r.devices]
    if not with_samples:
        return False
    fig, (busy, mem) = plt.subplots(1, 2, figsize=(13, 4))
    _over_time(busy, mem, with_samples, device_series)
    gpu = any(rec.get("gpus") for r in with_samples for rec in r.devices)
    busy.set_title("GPU utilisation (%)" if gpu else "CPU % per rank (100 = one core)")
    mem.set_title("GPU memory used (GiB)" if gpu else "resident memory per rank (GiB)")
    for ax in (busy, mem):
        ax.set_xlabel("seconds since the first sample")
        ax.grid(alpha=0.3)
    busy.legend(fontsize=8)
    _save(fig, path)
    return True


def _over_time(busy, mem, runs: list[Run], series) -> None:
    """Busy % and memory (GiB) of each labelled series (`series(run.devices)`) against the seconds since
    each run's first sample; labels carry the run's name when there are several."""
    for run in runs:
        t0 = run.devices[0]["t"]
        tag = f"{run.name} " if len(runs) > 1 else ""
        for label, points in series(run.devices).items():
            ts = [p[0] - t0 for p in points]
            busy.plot(ts, [p[1] for p in points], label=tag + label, linewidth=1)
            mem.plot(ts, [p[2] / GIB for p in points], label=tag + label, linewidth=1)


def progress(runs: list[Run], path: Path) -> bool:
    """A launched script's samples and samples/s against the time since its first progress line."""
    with_points = [r for r in runs if r.launched is not None and r.launched.points]
    if not with_points:
        return False
    fig, (done, rate) = plt.subplots(1, 2, figsize=(13, 4))
    for run in with_points:
        pts = run.launched.points
        t0 = pts[0].t
        done.plot([p.t - t0 for p in pts], [p.samples for p in pts], label=run.name, linewidth=1.2)
        pairs = run.launched.rates()
        rate.plot([t - t0 for t, _ in pairs], [y for _, y in pairs], label=run.name, linewidth=1)
    done.set_title("samples (rank 0's progress lines)")
    rate.set_title("samples / s")
    for ax in (done, rate):
        ax.set_xlabel("seconds since the first progress line")
        ax.grid(alpha=0.3)
    done.legend(fontsize=8)
    _save(fig, path)
    return True


def environment(runs: list[Run], path: Path) -> bool:
    """An agent run's env/* and tools/* metrics against the step, and each environment server's CPU% and memory."""
    keys = list(dict.fromkeys(k for r in runs for k in r.agent_keys()))
    servers = [r for r in runs if env_server_series(r.devices)]
    if not keys and not servers:
        return False
    n = len(keys) + 2 * bool(servers)
    cols = min(n, 3)
    fig, axes = plt.subplots(
        (n + cols - 1) // cols, cols, figsize=(13, 3.3 * ((n + cols - 1) // cols)), squeeze=False
    )
    flat = list(axes.flat)
    for ax, key in zip(flat, keys, strict=False):
        for run in runs:
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, label=run.name, linewidth=1.2)
        ax.set_title(key)
        ax.set_xlabel("step")
    if servers:
        cpu, mem = flat[len(keys)], flat[len(keys) + 1]
        _over_time(cpu, mem, servers, env_server_series)
        cpu.set_title("env server CPU % (100 = one core)")
        mem.set_title("env server resident memory (GiB)")
        for ax in (cpu, mem):
            ax.set_xlabel("seconds since the first sample")
        cpu.legend(fontsize=8)
    for ax in flat[n:]:
        ax.axis("off")
    for ax in flat[:n]:
        ax.grid(alpha=0.3)
    _save(fig, path)
    return True
