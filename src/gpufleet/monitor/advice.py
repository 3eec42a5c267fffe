"""Imbalance and waste, computed from the run's own numbers: pure functions, each returning the warnings
(one line: the roles, the numbers, a suggestion derived from them) for a window of recent records.

* `device_balance`: devices.jsonl records. Per device (GPU utilisation; on a CPU-only machine each
  rank's CPU%), the mean over the window, grouped by the role on it. A dedicated scorer far less busy
  than the policy devices -> colocate it and train on its device; policy devices idle while the
  scorer is saturated -> the scorer is the bottleneck; policy devices far apart -> the busy one holds
  the others back (note 001's 90 / 30 / 50).
* `rank_balance`: metrics.jsonl records with per-rank timings. A rank that spends a large share of its
  step waiting in collectives while another hardly waits: name both and the slow rank's largest phase.
* `memory_vs_plan`: the measured peak against `gpufleet plan`'s prediction: far below (room for a larger
  batch, quoting the largest per_device_batch the plan says fits) or above (the plan was optimistic).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.monitor.runfiles import device_label, several_nodes

IDLE_GAP = 30.0
"""Points of utilisation between two devices that count as an imbalance."""
WAIT_SHARE = 0.25
"""Share of a rank's step spent in collectives that counts as waiting on another rank."""
LOW_MEMORY, HIGH_MEMORY = 0.5, 1.1
"""Measured / planned peak memory below or above which memory_vs_plan speaks."""


@dataclass(frozen=True)
class Advice:
    kind: str
    """What it is about (one warning of a kind is printed per run): `devices`, `ranks`, `memory`."""
    text: str


def _device_means(records: Sequence[dict]) -> list[tuple[str, str, float]]:
    """(label, role, mean busy %) per GPU, or per rank (CPU%) when there are no GPUs; every node's
    devices (labels carry the node on a run over several: runfiles.py `device_label`)."""
    multi = several_nodes(list(records))
    if any(r.get("gpus") for r in records):
        by: dict[tuple[int, int], list[float]] = {}
        roles: dict[tuple[int, int], str] = {}
        for rec in records:
            rank_role = {x["rank"]: x["role"] for x in rec.get("ranks", [])}
            for g in rec["gpus"]:
                if g.get("util") is not None and g.get("ranks"):
                    key = (rec.get("node", 0), g["index"])
                    by.setdefault(key, []).append(float(g["util"]))
                    roles[key] = "+".join(sorted({rank_role.get(k, "?") for k in g["ranks"]}))
        return [
            (device_label("GPU", i, n, multi), roles[n, i], statistics.fmean(v))
            for (n, i), v in sorted(by.items())
        ]
    per_rank: dict[int, list[float]] = {}
    roles_r: dict[int, tuple[str, int]] = {}
    for rec in records:
        for x in rec.get("ranks", []):
            if x.get("pids"):
                per_rank.setdefault(x["rank"], []).append(min(float(x["cpu_percent"]), 100.0))
                roles_r[x["rank"]] = (x["role"], rec.get("node", 0))
    return [
        (device_label("rank", k, roles_r[k][1], multi), roles_r[k][0], statistics.fmean(v))
        for k, v in sorted(per_rank.items())
    ]


def device_balance(records: Sequence[dict], score_share: float | None = None) -> list[Advice]:
    """See the module docstring; `score_share`: timing/score / step_time over the same window."""
    means = _device_means(records)
    policy = [m for m in means if m[1].startswith("policy")]
    scorers = [m for m in means if m[1].startswith("scorer")]
    if not policy:
        return []
    p_mean = statistics.fmean(m[2] for m in policy)
    out = []
    for label, role, busy in scorers:
        what = role.removeprefix("scorer: ")
        if p_mean - busy >= IDLE_GAP:
            out.append(
                Advice(
                    "devices",
                    f"{label} ({role}) is busy {busy:.0f}% while the policy devices average {p_mean:.0f}%: "
                    f"colocate the {what} (placement.reference=colocate / placement.reward=colocate) and "
                    f"train on {label} too (one more policy rank); check with gpufleet plan",
                )
            )
        elif busy - p_mean >= IDLE_GAP:
            share = f"; timing/score is {score_share:.0%} of the step" if score_share is not None else ""
            out.append(
                Advice(
                    "devices",
                    f"the policy devices are busy {p_mean:.0f}% waiting on {label} ({role}) at {busy:.0f}%"
                    f"{share}: the {what} is the bottleneck; give it a device of its own per node or "
                    "colocate it on every policy rank so the scoring is split",
                )
            )
    if len(policy) > 1:
        hi, lo = max(policy, key=lambda m: m[2]), min(policy, key=lambda m: m[2])
        if hi[2] - lo[2] >= IDLE_GAP:
            out.append(
                Advice(
                    "devices",
                    f"{lo[0]} ({lo[1]}) is busy {lo[2]:.0f}% but {hi[0]} ({hi[1]}) {hi[2]:.0f}%: the policy "
                    f"ranks do equal work, so {hi[0]} holds the others back; see timing/*/rank<r> for its "
                    "slowest phase, and move what else runs on it (a colocated scorer, other processes) away",
                )
            )
    return out


def rank_balance(window: Sequence[dict]) -> list[Advice]:
    """See the module docstring: metrics records carrying `timing/comm/rank<r>` and `step_time/rank<r>`."""
    ranks = sorted(
        int(k.rsplit("rank", 1)[1])
        for k in (window[-1] if window else {})
        if k.startswith("timing/comm/rank")
    )
    if len(ranks) < 2:
        return []

    def share(r: int) -> float:
        wait = sum(m[f"timing/comm/rank{r}"] for m in window)
        return wait / max(sum(m[f"step_time/rank{r}"] for m in window), 1e-9)

    waits = {r: share(r) for r in ranks}
    waiting, slow = max(waits, key=waits.get), min(waits, key=waits.get)
    if waits[waiting] < WAIT_SHARE or waits[waiting] - waits[slow] < WAIT_SHARE / 2:
        return []
    phases = [k.split("/")[1] for k in window[-1] if k.startswith("timing/") and k.endswith(f"/rank{slow}")]
    phases = [p for p in phases if p not in ("comm", "other")]
    top = max(phases, key=lambda p: sum(m[f"timing/{p}/rank{slow}"] for m in window))
    secs = statistics.fmean(m[f"timing/{top}/rank{slow}"] for m in window)
    return [
        Advice(
            "ranks",
            f"rank {waiting} waits {waits[waiting]:.0%} of its step in collectives for rank {slow} "
            f"(waits {waits[slow]:.0%}), whose slowest phase is {top} ({secs:.2f} s/step): the ranks do equal "
            f"work, so look at what slows rank {slow}'s device (devices.jsonl) or move it off that device",
        )
    ]


def memory_vs_plan(
    ratio: float | None,
    peak_gib: float,
    planned_gib: float | None,
    batch: int,
    largest: int | None,
    overhead_gib: float = 0.0,
) -> list[Advice]:
    """See the module docstring; `largest`: the plan's largest per_device_batch that fits (None: unknown);
    `overhead_gib`: the plan's fixed per-process overhead within `planned_gib` (CUDA context, workspaces).
    Silent when the job's own tensors are smaller than that overhead: the ratio then measures the overhead
    estimate, not the job (a tiny model on an 80 GB card is not "room for a 5000x larger batch")."""
    if ratio is None or not planned_gib or planned_gib - overhead_gib < overhead_gib:
        return []
    head = f"peak memory {peak_gib:.2f} GiB is {ratio:.0%} of the plan's {planned_gib:.2f} GiB"
    if ratio < LOW_MEMORY:
        more = (
            f"; gpufleet plan says train.per_device_batch up to {largest} fits (now {batch})"
            if largest and largest > batch
            else ""
        )
        return [Advice("memory", f"{head}: room for a larger batch or longer completions{more}")]
    if ratio > HIGH_MEMORY:
        return [
            Advice(
                "memory",
                f"{head}: above the prediction; keep >= 10% free (lower train.per_device_batch or set "
                "train.micro_batch) and report the job: the planner missed something",
            )
        ]
    return []
