"""What a run directory holds for `gpufleet report` and `gpufleet watch`, read tolerantly (a run still
being written has a half line at the end of its files; a run without monitoring has fewer files)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.errors import UserError


def read_jsonl(path: Path) -> list[dict]:
    """Every whole record of a JSONL file ([] when it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@dataclass
class Run:
    """One run directory's monitoring files."""

    path: Path
    metrics: list[dict] = field(default_factory=list)
    devices: list[dict] = field(default_factory=list)
    warnings: list[dict] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    job_yaml: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the run (steps that lack it are skipped)."""
        pts = [(int(m["step"]), float(m[key])) for m in self.metrics if key in m and "step" in m]
        return [s for s, _ in pts], [v for _, v in pts]

    @property
    def ranks(self) -> list[int]:
        """The policy ranks whose timings the metrics carry ([0] for one process)."""
        last = self.metrics[-1] if self.metrics else {}
        found = sorted(int(k.rsplit("rank", 1)[1]) for k in last if k.startswith("step_time/rank"))
        return found or [0]


def load_run(path: str | Path) -> Run:
    """The run in `path`; a folder that holds no run is a UserError naming what is missing."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"{path} is not a folder.", fix="pass a run directory (the job's output.dir)")
    if not (p / "metrics.jsonl").exists() and not (p / "devices.jsonl").exists():
        raise UserError(
            f"{path} holds no metrics.jsonl or devices.jsonl: not a gpufleet run directory (yet).",
            fix="pass the job's output.dir, e.g. runs/quickstart",
        )
    try:
        plan = json.loads((p / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        plan = {}
    try:
        job_yaml = (p / "job.yaml").read_text(encoding="utf-8")
    except OSError:
        job_yaml = ""
    return Run(
        p,
        read_jsonl(p / "metrics.jsonl"),
        read_jsonl(p / "devices.jsonl"),
        read_jsonl(p / "warnings.jsonl"),
        plan,
        job_yaml,
    )


def max_steps(run: Run) -> int | None:
    """train.max_steps from the run's job.yaml, a default included (None when it cannot be read)."""
    import re

    found = re.search(r"^\s*(?:#\s*)?max_steps:\s*(\d+)", run.job_yaml, re.MULTILINE)  # train: comes first
    return int(found.group(1)) if found else None
