"""The global batch: completions per optimizer step over all policy ranks, and how it follows the rank
count. Unset `train.global_batch`: per_device_batch x ranks (grows with the ranks, as in TRL).
Set: per_device_batch = global_batch / ranks, so a job keeps its effective batch on any number of GPUs."""

from __future__ import annotations

from gpufleet.config.load import Resolved
from gpufleet.config.problems import Problem, Source
from gpufleet.text import plural

_SET_BY_USER = ("file", "env", "flag")


def apply_global_batch(r: Resolved, policy_ranks: int) -> list[Problem]:
    """Derive train.per_device_batch (and an unset micro_batch) from train.global_batch, in place."""
    t = r.job.train
    if t.global_batch is None or policy_ranks < 1:
        return []
    gb, ranks = t.global_batch, policy_ranks
    if gb % ranks:
        lower, upper = gb - gb % ranks, gb - gb % ranks + ranks
        near = sorted((d for d in range(1, gb + 1) if gb % d == 0), key=lambda d: (abs(d - ranks), d))[:2]
        return [
            Problem(
                "error",
                [r.ref("train.global_batch")],
                f"train.global_batch {gb} does not split evenly over {plural(ranks, 'policy rank')}.",
                f"--set train.global_batch={upper}"
                + (f" (or {lower})" if lower else "")
                + f", or run {' or '.join(map(str, sorted(near)))} policy ranks",
            )
        ]
    per = gb // ranks
    if r.source("train.per_device_batch").kind in _SET_BY_USER and t.per_device_batch != per:
        return [
            Problem(
                "error",
                [r.ref("train.global_batch"), r.ref("train.per_device_batch")],
                f"train.global_batch {gb} over {plural(ranks, 'policy rank')} means {per} per device, "
                f"but train.per_device_batch is set to {t.per_device_batch}.",
                "set only one of them (global_batch keeps the effective batch when the rank count changes)",
            )
        ]
    t.per_device_batch = per
    r.sources["train.per_device_batch"] = Source("derived", f"= train.global_batch / {ranks}")
    if r.source("train.micro_batch").kind == "derived":
        t.micro_batch = per
    return []


def batch_note(r: Resolved, policy_ranks: int) -> str | None:
    """One line when the global batch follows the rank count (None on one rank or when it is pinned)."""
    t = r.job.train
    if t.global_batch is not None or policy_ranks <= 1:
        return None
    gb = t.per_device_batch * policy_ranks
    return (
        f"note: {gb} completions per optimizer step = per_device_batch {t.per_device_batch} x "
        f"{plural(policy_ranks, 'policy rank')} (on 1 rank this job takes {t.per_device_batch}). To keep one "
        f"number on any rank count set train.global_batch (e.g. --set train.global_batch={t.per_device_batch}). "
        f"The learning rate is not scaled: each step averages {policy_ranks}x more completions (less noise, "
        f"same step size) and max_steps consumes {policy_ranks}x more prompts."
    )
