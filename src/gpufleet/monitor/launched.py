"""What `gpufleet watch` and `gpufleet report` show of a `gpufleet launch`ed script (anyone's training
script), read from its run folder, tolerantly (the files a launch leaves depend on its version):

* launch.json (written by `gpufleet launch`, launch/scriptrun.py): the resolved launch, {"command": argv,
  "nproc", "nnodes", "recipe", "env", "started", ...}; the recipe {"batch_rule", "lr_rule", "reference":
  {...}, "now": {...}} (null when the job has none), each side {devices, per_device_batch,
  gradient_accumulation_steps, effective_batch, learning_rate, max_steps};
* logs/progress.jsonl: rank 0's progress lines ({t, samples}; script.progress_regex, by default what
  `gpufleet.progress.report(samples)` prints), timestamped by the launcher as they arrive;
* logs/rank<R>.log: each rank's output (its last line is shown), logs/rank<R>.exit.json: a failed rank.

Samples per second are taken over the last WINDOW progress lines (a rate that follows the run, not its
start-up); progress and ETA need the recipe's max steps and effective batch (launch.json).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.launch.scaling import Point, read_points

WINDOW = 20
"""Progress lines the samples/s is measured over (the newest)."""

RECIPE_ROWS = (
    ("devices", "devices"),
    ("per_device_batch", "per-device batch"),
    ("gradient_accumulation_steps", "gradient accumulation"),
    ("effective_batch", "effective batch"),
    ("learning_rate", "learning rate"),
    ("max_steps", "max steps"),
)


@dataclass
class Launched:
    """A launched script's files (empty where a file is missing)."""

    launch: dict = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    last_lines: dict[int, str] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)

    @property
    def recipe_now(self) -> dict:
        recipe = self.launch.get("recipe") or {}
        if not isinstance(recipe, dict):
            return {}
        return recipe.get("now") if isinstance(recipe.get("now"), dict) else recipe

    @property
    def total_samples(self) -> int | None:
        """max steps x effective batch of the recipe in use (None when the recipe does not say)."""
        now = self.recipe_now
        batch = now.get("effective_batch")
        if batch is None and now.get("per_device_batch"):
            batch = (
                now["per_device_batch"] * now.get("gradient_accumulation_steps", 1) * now.get("devices", 1)
            )
        steps = now.get("max_steps")
        return int(batch * steps) if batch and steps else None

    @property
    def samples(self) -> int:
        return self.points[-1].samples if self.points else 0

    def rate(self) -> float | None:
        """Samples per second over the newest WINDOW progress lines (None with fewer than two)."""
        pts = self.points[-WINDOW:]
        if len(pts) < 2 or pts[-1].t <= pts[0].t:
            return None
        return (pts[-1].samples - pts[0].samples) / (pts[-1].t - pts[0].t)

    def rates(self) -> list[tuple[float, float]]:
        """(time, samples/s since the line before) of each progress line after the first."""
        pts = self.points
        return [
            (b.t, (b.samples - a.samples) / (b.t - a.t))
            for a, b in zip(pts, pts[1:], strict=False)
            if b.t > a.t
        ]

    def eta_s(self) -> float | None:
        total, rate = self.total_samples, self.rate()
        if total is None or not rate:
            return None
        return max(total - self.samples, 0) / rate

    def failed(self, last_line: bool = False) -> str | None:
        """`rank 1 exit 3` of the first rank that failed, None when none did; `last_line`: with that rank's
        last output line after a colon (its error, most often), where it printed one."""
        if not self.failures:
            return None
        first = min(self.failures, key=lambda f: f.get("time", 0.0))
        said = f"rank {first.get('rank', '?')} exit {first.get('code', '?')}"
        words = self.last_lines.get(first.get("rank")) if last_line else None
        return f"{said}: {words}" if words else said

    def command(self) -> str:
        import shlex

        cmd = self.launch.get("command")
        return shlex.join(map(str, cmd)) if isinstance(cmd, list) else str(cmd or "")

    def recipe_rows(self) -> list[tuple[str, str, str]]:
        """(quantity, reference, now) rows of the recipe table ('-' where a side does not say)."""
        recipe = self.launch.get("recipe") or {}
        if not isinstance(recipe, dict) or not recipe:
            return []
        ref = recipe.get("reference") if isinstance(recipe.get("reference"), dict) else {}
        now = self.recipe_now
        keys = [k for k, _ in RECIPE_ROWS if k in ref or k in now]
        keys += [k for k in {**ref, **now} if k not in keys]
        names = dict(RECIPE_ROWS)
        rows = [(names.get(k, k), fmt(ref.get(k)), fmt(now.get(k))) for k in keys]
        rules = [f"{k} {recipe[k]}" for k in ("batch_rule", "lr_rule") if recipe.get(k)]
        return rows + ([("rules", "-", ", ".join(rules))] if rules else [])


def fmt(v) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def last_line(path: Path, tail: int = 4096) -> str:
    """The last non-empty line of a log (its last `tail` bytes are read), '' when there is none."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - tail, 0))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def read_launched(path: Path) -> Launched | None:
    """The launched script in run folder `path`; None when the folder holds none (a `train` run has
    metrics.jsonl; its logs/rank<R>.log are the trainer's)."""
    logs = path / "logs"
    try:
        launch = json.loads((path / "launch.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        launch = {}
    points = read_points(logs / "progress.jsonl")
    ranks = {}
    for p in logs.glob("rank*.log"):
        m = re.fullmatch(r"rank(\d+)\.log", p.name)
        if m:
            ranks[int(m.group(1))] = last_line(p)
    if not (launch or points or ranks):
        return None
    failures = []
    for p in logs.glob("rank*.exit.json"):
        try:
            failures.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return Launched(launch if isinstance(launch, dict) else {}, points, dict(sorted(ranks.items())), failures)
