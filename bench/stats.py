"""Pure statistics of `vs_trl.py`: medians and means that tolerate empty lists, the learning-curve numbers
(AUC, steps to reach a moving-average target) and the seed-noise test of the AUC difference (Welch's t
and a percentile bootstrap CI; no scipy needed)."""

from __future__ import annotations

import math
import random
import statistics

MA_WINDOW = 10  # moving-average window of the "steps to reach" statistic
MA_TARGET = 0.8


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def sd(xs: list[float]) -> float:
    """Sample standard deviation (n - 1); 0 for a single value."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def auc(rewards: list[float]) -> float:
    """Area under the reward curve per step: the mean reward over all steps of one run."""
    return mean(rewards)


def steps_to_reach(rewards: list[float], window: int = MA_WINDOW, target: float = MA_TARGET) -> int | None:
    """First step (1-based) whose `window`-step moving average (that step and the window - 1 before it)
    reaches `target`; None if no step does."""
    for end in range(window, len(rewards) + 1):
        if mean(rewards[end - window : end]) >= target:
            return end
    return None


def welch(x: list[float], y: list[float]) -> tuple[float, float]:
    """Welch's t statistic of mean(x) - mean(y) and its Welch-Satterthwaite degrees of freedom."""
    vx, vy = sd(x) ** 2 / len(x), sd(y) ** 2 / len(y)
    diff = mean(x) - mean(y)
    if vx + vy == 0:
        return (0.0 if diff == 0 else math.copysign(math.inf, diff)), float("nan")
    df_den = (vx**2 / (len(x) - 1) if len(x) > 1 else 0) + (vy**2 / (len(y) - 1) if len(y) > 1 else 0)
    return diff / math.sqrt(vx + vy), ((vx + vy) ** 2 / df_den if df_den else float("nan"))


def bootstrap_ci(
    x: list[float], y: list[float], n: int = 20000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(x) - mean(y): seeds resampled with replacement within each trainer.
    (With 3 seeds per trainer it is narrow-biased: a resample sees at most 3 distinct values.)"""
    rng = random.Random(seed)
    diffs = sorted(mean(rng.choices(x, k=len(x))) - mean(rng.choices(y, k=len(y))) for _ in range(n))
    lo = diffs[int((1 - level) / 2 * n)]
    hi = diffs[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


def learning_stats(results: dict[str, list[dict]]) -> dict:
    """Per-seed AUC and steps-to-0.8 of each trainer, and the AUC difference gpufleet - TRL."""
    out: dict = {}
    for kind in ("gpufleet", "trl"):
        runs = results[kind]
        out[kind] = {
            "seeds": [r["seed"] for r in runs],
            "auc": [auc(r["reward"]) for r in runs],
            "reach": [steps_to_reach(r["reward"]) for r in runs],
        }
    g, t = out["gpufleet"]["auc"], out["trl"]["auc"]
    out["diff"] = mean(g) - mean(t)
    out["t"], out["df"] = welch(g, t) if min(len(g), len(t)) > 1 else (float("nan"), float("nan"))
    out["ci"] = bootstrap_ci(g, t)
    out["t_small"] = abs(out["t"]) < 2
    out["ci_has_0"] = out["ci"][0] <= 0 <= out["ci"][1]
    out["equal"] = out["t_small"] and out["ci_has_0"]
    return out
