"""Achieved FLOP/s per phase of gpufleet's step, and over the whole step of both trainers, as a fraction
of the machine's matmul peak (`gemm_peak.py`); printed by `vs_trl.py` after the speed table.

Phase times are gpufleet's own `timing/<phase>` metrics (wall seconds per step, metrics.jsonl). On a
shared machine wall time includes time other processes held the core, so each phase's wall time is
scaled by its run's CPU / wall ratio over the same steps (the process's CPU time per step is known; its
split over phases is not: this assumes the interference is spread evenly over the step). FLOPs come
from `flops.step_flops` at each step's longest completion (the padded width both trainers compute
over). TRL's per-step FLOPs are taken as gpufleet's (same model, batch, sampling settings; its
per-step longest completion is not recorded): its step-level figure is an estimate.
"""

from __future__ import annotations

from flops import step_flops
from stats import med

PHASES = ("generate", "score", "backward", "optimizer", "checkpoint", "other")


def step_key(peak: dict) -> str:
    """The per-step time the figures use: CPU time on the CPU, wall time on a GPU (where the CPU time of
    the launching thread says nothing about the GPU's work)."""
    return "cpu_step_time" if peak.get("device", "cpu") == "cpu" else "step_time"


def cpu_factor(run: dict, warmup: int, key: str = "cpu_step_time") -> float:
    """CPU / wall over the run's steps after `warmup` (1.0: the process had a core to itself, or on a GPU)."""
    wall, cpu = sum(run["step_time"][warmup:]), sum(run[key][warmup:])
    return cpu / wall if wall > 0 else 1.0


def phase_table(
    cfg: dict,
    batch: int,
    prompt: int,
    beta: float,
    runs: list[dict],
    trl: list[dict],
    warmup: int,
    peak: dict,
    goal: float | None = None,
) -> list[str]:
    """Markdown lines: per phase the FLOPs per step, CPU-scaled seconds (the median over the steps, as the
    whole step's: a final checkpoint's save, one step of many, shows in neither), GFLOP/s and fraction of
    peak; then the whole step of each trainer (CPU time per step); then the floor (`floor_lines`)."""
    flops = dict.fromkeys((*PHASES, "total"), 0.0)
    secs: dict[str, list[float]] = {ph: [] for ph in PHASES}
    steps = 0
    key = step_key(peak)
    for run in runs:
        factor = cpu_factor(run, warmup, key)
        for s in range(warmup, len(run["max_length"])):
            f = step_flops(cfg, batch, prompt, int(run["max_length"][s]), beta)
            for k, v in f.items():
                flops[k] += v
            for ph in PHASES:
                secs[ph].append(run["timing"].get(f"timing/{ph}", [0.0] * (s + 1))[s] * factor)
            steps += 1
    after = [r["peak"] for r in (*runs, *trl) if "peak" in r]  # measured after each run (measure.add_peak)
    peak_cpu = max([peak["peak_cpu"], *after])  # a slow moment's measurement is not the machine's peak
    peak = peak | {"peak_cpu": peak_cpu}
    square, device = peak.get("square", 1024), peak.get("device", "cpu")
    clock = "CPU time" if key == "cpu_step_time" else "wall time"
    where = f"{peak['threads']} thread(s)" if device == "cpu" else device
    lines = [
        f"Matmul peak (`bench/gemm_peak.py`, {peak.get('dtype', 'float32')}, {where}, best shape of the step"
        f"{', the best of the measurement before the runs and those after each' if after else ''}): "
        f"{peak_cpu / 1e9:.1f} GFLOP/s by {clock} ({peak['peak_wall'] / 1e9:.1f} by wall time before the runs; "
        f"{square}^3 square {peak['square_cpu'] / 1e9:.1f}).",
        "",
        f"| gpufleet phase | GFLOP per step | ms per step ({'CPU-scaled' if device == 'cpu' else 'wall'}) | GFLOP/s | fraction of peak |",
        "|---|---:|---:|---:|---:|",
    ]
    for ph in PHASES:
        f, t = flops.get(ph, 0.0) / max(steps, 1), med(secs[ph]) if secs[ph] else 0.0
        rate = f / t if t > 0 else 0.0
        frac = f"{rate / peak_cpu:.0%}" if f > 0 else "-"
        lines.append(f"| {ph} | {f / 1e9:.2f} | {t * 1000:.0f} | {rate / 1e9:.1f} | {frac} |")
    total = flops["total"] / max(steps, 1)
    cpus = {}
    for name, rs in (("gpufleet", runs), ("TRL 1.16", trl)):
        cpus[name] = cpu = med([x for r in rs for x in r[key][warmup:]])
        lines.append(
            f"| **{name}, whole step** ({clock}) | {total / 1e9:.2f} | {cpu * 1000:.0f} | {total / cpu / 1e9:.1f} | **{total / cpu / peak_cpu:.0%}** |"
        )
    per_step = {k: v / max(steps, 1) for k, v in flops.items()}
    useful = _attended_flops(cfg, batch, prompt, beta, runs, warmup)
    if useful:
        lines += [
            "",
            f"Counting only the tokens the rows hold (each step at its mean completion length, not its "
            f"longest): {useful / 1e9:.2f} GFLOP per step, gpufleet {useful / cpus['gpufleet'] / peak_cpu:.0%} "
            "of the peak.",
        ]
    return [
        *lines,
        "",
        *run_peak_lines(total, runs, trl, warmup, key),
        *floor_lines(per_step, peak, cpus["TRL 1.16"], goal),
    ]


def _attended_flops(cfg: dict, batch: int, prompt: int, beta: float, runs: list[dict], warmup: int) -> float:
    """FLOPs per step over the tokens the rows hold (the step's mean completion length for every row; no
    decoding past a row's end), mean over the runs' steps after `warmup`; 0 without the lengths."""
    lengths = [x for r in runs for x in r.get("completion_length", [])[warmup:]]
    if not lengths:
        return 0.0
    return sum(step_flops(cfg, batch, prompt, max(1, round(n)), beta)["total"] for n in lengths) / len(
        lengths
    )


def run_peak_lines(total: float, runs: list[dict], trl: list[dict], warmup: int, key: str) -> list[str]:
    """The whole step against the peak each run's own process measured right after its steps
    (`measure.add_peak`; the machine's clock as that run found it): per run, FLOPs per step / its median
    step time / its peak, the median over runs. None where the results have no such peak (older files)."""
    every = [*runs, *trl]
    if not every or any("peak" not in r for r in every):
        return []

    def fraction(rs: list[dict]) -> float:
        return med([total / med(r[key][warmup:]) / r["peak"] for r in rs])

    peaks = sorted(r["peak"] / 1e9 for r in every)
    return [
        f"Against the peak each run's process measured right after its steps ({peaks[0]:.1f}-{peaks[-1]:.1f} "
        f"GFLOP/s, median {med(peaks):.1f}): gpufleet **{fraction(runs):.0%}**, TRL {fraction(trl):.0%} "
        "(median over runs of FLOPs per step / the run's median step / its peak).",
        "",
    ]


def floor_lines(flops: dict[str, float], peak: dict, trl_step: float, goal: float | None) -> list[str]:
    """What the step could take at best on this machine, and what a step-time `goal` (a ratio to TRL's
    CPU time per step, `trl_step` seconds) asks of it. Two floors: every FLOP at the peak; and decoding
    at the best rate `gemm_peak.py` measured at the decode rows (each shape timed alone, its weight hot
    in cache: optimistic for a decode step, which reads a dozen weights in turn), the rest at the peak."""
    peak_cpu = peak["peak_cpu"]
    decode_rate = max(
        (s["cpu_flops"] for s in peak["shapes"] if s["name"].startswith("decode")), default=peak_cpu
    )
    at_peak = flops["total"] / peak_cpu
    at_shapes = flops["generate"] / decode_rate + (flops["total"] - flops["generate"]) / peak_cpu
    text = (
        f"Floor on this machine: {at_peak * 1000:.0f} ms per step with every FLOP at the peak "
        f"({at_peak / trl_step:.2f} of TRL's step); {at_shapes * 1000:.0f} ms ({at_shapes / trl_step:.2f}) with "
        f"decoding at the best decode-row matmul rate ({decode_rate / 1e9:.1f} GFLOP/s) and the rest at the peak."
    )
    if goal:
        need = flops["total"] / (goal * trl_step)
        text += f" A ratio of {goal:g} needs {need / 1e9:.1f} GFLOP/s over the whole step: {need / peak_cpu:.0%} of the peak."
    return [text]
