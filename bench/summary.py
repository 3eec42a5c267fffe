"""The end of `vs_trl.py`: the reward table and the summary block for the README (speed table, and with
`--preset learn` the learning-curve comparison), from the result files of all runs."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from measure import (
    PROMPT_WIDTH,
    STARTUP_GPUFLEET,
    STARTUP_GPUFLEET_FULL,
    STARTUP_PYTHON,
    STARTUP_TRL,
    STARTUP_TRL_FULL,
    TEMPERATURE,
    Preset,
    model_config,
)
from phases import phase_table
from stats import MA_TARGET, MA_WINDOW, learning_stats, mean, med, sd

GOALS = {"speed": 0.35, "small": 0.6}
"""Issue 14's goals for gpufleet / TRL step time, by preset."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def hardware(a: argparse.Namespace) -> str:
    """Where the run ran: the CPU, and the GPU's name with `--device cuda`."""
    where = f"{cpu_model()}, {os.cpu_count()} cores"
    if a.device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(0)}, {a.precision} (host: {where})"
    return where


def versions() -> str:
    import importlib.metadata as md

    return ", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "trl", "accelerate"))


def model_params(p: Preset) -> int:
    """Parameters of preset `p`'s model (from its config.json: embedding, layers, norms; tied head once)."""
    from flops import head_params, layer_params

    cfg = model_config(p)
    extra = 0 if cfg.get("tie_word_embeddings") else head_params(cfg)
    return head_params(cfg) + layer_params(cfg) + extra


def seeds_text(a: argparse.Namespace) -> str:
    return ",".join(map(str, a.seeds))


def reward_curves(a: argparse.Namespace, results: dict[str, list[dict]], work: Path) -> list[str]:
    """Print the reward per step (mean over seeds) every `a.every` steps, write curves.json; return the
    same rows as a markdown table for the learning summary."""
    k = a.every

    def curve(kind: str) -> list[float]:  # mean over seeds, per step
        runs = results[kind]
        return [mean([r["reward"][s] for r in runs]) for s in range(min(len(r["reward"]) for r in runs))]

    g_curve, t_curve = curve("gpufleet"), curve("trl")
    print(f"\nreward (mean over seeds {seeds_text(a)}); 'mean{k}' = mean of the {k} steps ending there")
    print(f"  {'step':>5}  {'gpufleet':>9} {'mean' + str(k):>7}   {'TRL':>9} {'mean' + str(k):>7}")
    curve_rows = []
    for s in range(k, len(g_curve) + 1, k):
        print(
            f"  {s:>5}  {g_curve[s - 1]:>9.3f} {mean(g_curve[s - k : s]):>7.3f}"
            f"   {t_curve[s - 1]:>9.3f} {mean(t_curve[s - k : s]):>7.3f}"
        )
        curve_rows.append(f"| {s} | {mean(g_curve[s - k : s]):.3f} | {mean(t_curve[s - k : s]):.3f} |")
    (work / "curves.json").write_text(json.dumps({"gpufleet": g_curve, "trl": t_curve}))
    return curve_rows


def side(runs: list[dict], warmup: int) -> dict[str, float]:
    """One trainer's numbers over all its seeds: step times pooled after `warmup` steps, then medians."""

    def pooled(key: str) -> list[float]:
        return [x for r in runs for x in r[key][warmup:]]

    return {
        "step": med(pooled("step_time")),
        "cpu": med(pooled("cpu_step_time")),
        "rss": max(r["peak_rss_mib"] for r in runs),
        "wall": med([r["process_s"] for r in runs]),
        "setup": med([r["setup_s"] for r in runs]),
        "first": mean([mean(r["reward"][:10]) for r in runs]),
        "last": mean([mean(r["reward"][-10:]) for r in runs]),
    }


def speed_table(
    a: argparse.Namespace, p: Preset, results: dict, startup: dict, g: dict, t: dict
) -> list[str]:
    """The markdown table gpufleet | TRL | ratio (`g`, `t`: each trainer's `side`): step time, CPU time,
    RSS, time to the first step, start-up, rewards."""

    def seed_ratios(key: str) -> str:
        per_seed = {kind: [med(r[key][a.warmup :]) for r in results[kind]] for kind in results}
        return ", ".join(f"{x / y:.2f}" for x, y in zip(per_seed["gpufleet"], per_seed["trl"], strict=True))

    def su(name: str) -> str:
        return f"{med(startup[name]) * 1000:.0f} ms" if name in startup else "-"

    def su_ratio(a_: str, b_: str) -> str:
        return f"{med(startup[a_]) / med(startup[b_]):.2f}" if a_ in startup and b_ in startup else "-"

    return [
        "| | gpufleet | TRL 1.16 | gpufleet / TRL |",
        "|---|---:|---:|---:|",
        f"| step time (wall, median) | {g['step'] * 1000:.0f} ms | {t['step'] * 1000:.0f} ms | **{g['step'] / t['step']:.2f}** (per seed: {seed_ratios('step_time')}) |",
        f"| step time (CPU time of the process, median) | {g['cpu'] * 1000:.0f} ms | {t['cpu'] * 1000:.0f} ms | **{g['cpu'] / t['cpu']:.2f}** (per seed: {seed_ratios('cpu_step_time')}) |",
        f"| wall / CPU per step (1.00: a core to itself) | {g['step'] / g['cpu']:.2f} | {t['step'] / t['cpu']:.2f} | |",
        f"| completions/s | {p.batch / g['step']:.1f} | {p.batch / t['step']:.1f} | {t['step'] / g['step']:.2f}x |",
        f"| peak RSS (ru_maxrss, max over seeds) | {g['rss']:.0f} MiB | {t['rss']:.0f} MiB | {g['rss'] / t['rss']:.2f} |",
        f"| time to the first step in the process (imports, model, trainer) | {g['setup']:.1f} s | {t['setup']:.1f} s | {g['setup'] / t['setup']:.2f} |",
        f"| whole training process, {a.steps} steps | {g['wall']:.1f} s | {t['wall']:.1f} s | {g['wall'] / t['wall']:.2f} |",
        f"| start-up: `gpufleet --version` vs `import trl` | {su(STARTUP_GPUFLEET)} | {su(STARTUP_TRL)} | {su_ratio(STARTUP_GPUFLEET, STARTUP_TRL)} |",
        f"| start-up: `import gpufleet.rl.trainer` vs `from trl import GRPOTrainer` | {su(STARTUP_GPUFLEET_FULL)} | {su(STARTUP_TRL_FULL)} | {su_ratio(STARTUP_GPUFLEET_FULL, STARTUP_TRL_FULL)} |",
        f"| reward, mean of first 10 steps | {g['first']:.3f} | {t['first']:.3f} | |",
        f"| reward, mean of last 10 steps | {g['last']:.3f} | {t['last']:.3f} | |",
    ]


def report(
    a: argparse.Namespace, p: Preset, results: dict, startup: dict, loads: list[float], work: Path, peak: dict
) -> None:
    """Print the reward table, then the summary block to paste into the README."""
    curve_rows = reward_curves(a, results, work)
    g, t = side(results["gpufleet"], a.warmup), side(results["trl"], a.warmup)
    contention = max(
        g["step"] / g["cpu"], t["step"] / t["cpu"]
    )  # ~1.0 when each process had a core to itself
    python = f"{med(startup[STARTUP_PYTHON]) * 1000:.0f} ms" if STARTUP_PYTHON in startup else "-"
    loadtxt = f"1-min load average {min(loads):.2f}-{max(loads):.2f} during the run, this benchmark's own ~1 included"
    lines = [
        "### gpufleet vs TRL GRPOTrainer (`bench/vs_trl.py`)",
        "",
        f"{hardware(a)} ({loadtxt}); torch.set_num_threads({a.threads}) in both; {versions()}.",
        f"Preset `{p.name}`. Both: {p.model} ({model_params(p) / 1e6:.2f}M weights) {a.precision}, builtin:repeat, {p.batch} completions/step ({p.batch // p.generations} prompts x "
        f"{p.generations} generations), {p.completion_tokens} completion tokens, temperature {TEMPERATURE}, beta {p.beta:g}, loss_type grpo, "
        f"lr {a.lr:g} constant, {a.steps} steps, seeds {seeds_text(a)}; median over steps after {a.warmup} warm-up steps, all seeds pooled.",
        "",
        *speed_table(a, p, results, startup, g, t),
        "",
        *phase_table(
            model_config(p),
            p.batch,
            PROMPT_WIDTH,
            p.beta,
            results["gpufleet"],
            results["trl"],
            a.warmup,
            peak,
            GOALS.get(p.name),
        ),
        "",
        *(learning_lines(a, learning_stats(results), curve_rows) if p.name == "learn" else []),
        f"(`python -c pass`: {python}. Goal for the step-time ratio: <= {GOALS.get(p.name, '-')}. Raw data: {work / 'results.json'}.)",
    ]
    if contention > 1.15 and a.device == "cpu":
        lines.append(
            f"(wall / CPU reached {contention:.2f}: other processes took CPU during the run, so the wall"
            " times are inflated and noisy; the CPU-time row is the one to compare.)"
        )
    print("\n" + "=" * 30 + " summary (paste into README) " + "=" * 30)
    print("\n".join(lines))
    print("=" * 89)


def verdict(ls: dict) -> str:
    """Whether the AUCs are equal within seed noise: both criteria (|t| < 2, CI contains 0) must agree."""
    if min(len(ls["gpufleet"]["auc"]), len(ls["trl"]["auc"])) < 2:
        return "no test: it needs at least 2 seeds per trainer"
    if ls["equal"]:
        return "**equal within seed noise** (|t| < 2 and the CI contains 0)"
    if not ls["t_small"] and not ls["ci_has_0"]:
        return "**different beyond seed noise** (|t| >= 2 and the CI excludes 0)"
    return (  # the two criteria disagree: not shown equal, not shown different
        "**not shown equal within seed noise** ("
        + ("|t| < 2" if ls["t_small"] else "|t| >= 2")
        + (", but the CI excludes 0" if not ls["ci_has_0"] else ", but the CI contains 0")
        + f"; more seeds needed, e.g. --seeds {','.join(str(42 + i) for i in range(10))})"
    )


def learning_lines(a: argparse.Namespace, ls: dict, curve_rows: list[str]) -> list[str]:
    """The learning-curve part of the summary: curves, per-seed AUC and steps to 0.8, the AUC test."""

    def fmt(xs) -> str:
        return ", ".join("-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x)) for x in xs)

    def reach(kind: str) -> str:
        got = [x for x in ls[kind]["reach"] if x is not None]
        if not got:
            return f"not reached in {a.steps} steps"
        txt = f"{mean(got):.0f} ± {sd(got):.0f}"
        n = len(ls[kind]["reach"])
        return txt if len(got) == n else f"{txt} ({len(got)} of {n} seeds reached it)"

    g, t = ls["gpufleet"], ls["trl"]
    lo, hi = ls["ci"]
    return [
        f"Reward curves, mean over seeds {seeds_text(a)}; each row is the mean of the {a.every} steps ending there:",
        "",
        "| step | gpufleet | TRL 1.16 |",
        "|---:|---:|---:|",
        *curve_rows,
        "",
        f"Learning, per seed ({', '.join(map(str, g['seeds']))} for gpufleet; {', '.join(map(str, t['seeds']))} for TRL). "
        f"AUC = mean reward over all {a.steps} steps; reach = first step whose {MA_WINDOW}-step moving average is >= {MA_TARGET:g}:",
        "",
        "| | gpufleet | TRL 1.16 |",
        "|---|---:|---:|",
        f"| AUC per seed | {fmt(g['auc'])} | {fmt(t['auc'])} |",
        f"| AUC, mean ± std over seeds | {mean(g['auc']):.3f} ± {sd(g['auc']):.3f} | {mean(t['auc']):.3f} ± {sd(t['auc']):.3f} |",
        f"| reach {MA_TARGET:g}, step per seed | {fmt(g['reach'])} | {fmt(t['reach'])} |",
        f"| reach {MA_TARGET:g}, mean ± std over seeds | {reach('gpufleet')} | {reach('trl')} |",
        "",
        f"AUC difference gpufleet - TRL: {ls['diff']:+.3f}; Welch t = {ls['t']:+.2f} (df {ls['df']:.1f}); "
        f"bootstrap 95% CI of the difference [{lo:+.3f}, {hi:+.3f}] -> {verdict(ls)}.",
        "",
    ]
