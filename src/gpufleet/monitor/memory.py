"""Peak memory of this process against the plan made before launch (`gpufleet plan`'s numbers).

Measured: on a GPU, `torch.cuda.max_memory_allocated` (tensors only: the plan's CUDA context and
allocator slack are not in it, so a GPU's ratio sits a little under 1 when the plan is right); on the
CPU, the process's peak resident set (`ru_maxrss`: everything, as the plan's CPU total counts).

Predicted: the launcher writes OUTPUT/plan.json (`write_plan`): the plan's bytes for each local rank
(policy ranks first, then scorer ranks: the layout of dist.py). No torch import at module level.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Mapping
from pathlib import Path

from gpufleet.fsfaults import write_text_atomic

PLAN_FILE = "plan.json"


def peak_bytes(device) -> int:
    """Peak bytes of this process on `device` so far (see the module docstring)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def plan_record(plan) -> dict:
    """What the run keeps of a plan: per local rank its role, device and predicted bytes."""
    ranks = []
    for d in plan.devices:
        for proc in d.processes:
            overhead = int(proc.detail.get("overhead", 0))  # the fixed per-process part (plan/overhead.py)
            ranks.append(
                {"role": proc.role, "device": d.label, "bytes": int(proc.total), "overhead_bytes": overhead}
            )
    policy = sorted(
        (r for r in ranks if r["role"].startswith("policy rank ")),
        key=lambda r: int(r["role"].split()[2]),
    )
    scorers = [r for r in ranks if not r["role"].startswith("policy rank ")]
    return {
        "hardware": plan.hardware.describe(),
        "fits": bool(plan.fits),
        "ranks": [{"local_rank": i, **r} for i, r in enumerate(policy + scorers)],
    }


def write_plan(r, hw, env: Mapping[str, str], out: Path) -> str | None:
    """Plan the resolved job on `hw` and keep it in OUTPUT/plan.json; a line saying why not, if not."""
    from gpufleet.errors import UserError
    from gpufleet.plan.search import make_plan

    try:
        plan, _ = make_plan(r, hw, env, choose=False)
    except UserError as e:
        return f"monitor: no memory plan to compare with ({e})"
    if plan is None:
        return "monitor: no memory plan to compare with (the job cannot be laid out)"
    record = plan_record(plan)
    if not hw.is_cpu:  # quoted by the memory warning (monitor/advice.py); a CPU's RAM is not the limit
        from gpufleet.plan.largest import largest_that_fits

        found = largest_that_fits(r, hw, env)
        record["largest_per_device_batch"] = found[0].largest if found else None
    write_text_atomic(out / PLAN_FILE, json.dumps(record, indent=1) + "\n")
    return None


def read_plan(out: Path) -> dict:
    """OUTPUT/plan.json ({} when there is none)."""
    try:
        return json.loads((out / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def planned_bytes(out: Path, local_rank: int) -> int | None:
    """The plan's bytes for `local_rank` of this run (None without a plan.json or that rank)."""
    for r in read_plan(out).get("ranks", []):
        if r.get("local_rank") == local_rank:
            return int(r["bytes"])
    return None


def memory_metrics(per_rank: list[tuple[float, float]]) -> dict[str, float]:
    """`memory/peak_gib` (rank 0), `/max` and `/rank<r>`; `memory/plan_gib` and `memory/plan_ratio`
    (measured / planned; `/max` the worst rank) where a plan exists (planned bytes 0 = none)."""
    gib = 1024**3
    m: dict[str, float] = {}
    peaks = [p / gib for p, _ in per_rank]
    m["memory/peak_gib"], m["memory/peak_gib/max"] = peaks[0], max(peaks)
    ratios = [p / q for p, q in per_rank if q > 0]
    if per_rank[0][1] > 0:
        m["memory/plan_gib"] = per_rank[0][1] / gib
        m["memory/plan_ratio"] = per_rank[0][0] / per_rank[0][1]
    if ratios:
        m["memory/plan_ratio/max"] = max(ratios)
    if len(per_rank) > 1:
        for r, (p, q) in enumerate(per_rank):
            m[f"memory/peak_gib/rank{r}"] = p / gib
            if q > 0:
                m[f"memory/plan_ratio/rank{r}"] = p / q
    return m
