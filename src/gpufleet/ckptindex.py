"""Which checkpoints a run folder holds and which one a job starts from (`output.resume`), and the
training state a checkpoint records: no torch, so `gpufleet check` can see what `train` would resume.
gpufleet.checkpoint (saving, loading weights) re-exports these."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.errors import UserError
from gpufleet.paths import user_path

LATEST = "latest"
STEP_PREFIX = "step-"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (renamed into place), oldest first."""
    root = run_dir / "checkpoints"
    steps = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith(STEP_PREFIX) and d.name[len(STEP_PREFIX) :].isdigit():
                if (d / "trainer_state.json").is_file():
                    steps.append(int(d.name[len(STEP_PREFIX) :]))
    return sorted(steps)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: the `latest` pointer, or a scan if the pointer is missing."""
    root = run_dir / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        if (root / name / "trainer_state.json").is_file():
            return root / name
    steps = complete_steps(run_dir)
    return root / f"{STEP_PREFIX}{steps[-1]}" if steps else None


@dataclass
class TrainingState:
    """What a checkpoint restores besides the weights."""

    step: int
    scheduler: dict[str, Any]
    layout: dict[str, Any]
    controllers: dict[str, Any] = field(default_factory=dict)
    """Trainer state beyond the optimizer's (e.g. the adaptive entropy controller), by name."""


def load_state(path: Path) -> TrainingState:
    data = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    return TrainingState(data["step"], data["scheduler"], data["layout"], data.get("controllers", {}))


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to start from: `auto` newest in run_dir, `never` none, or the given path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(run_dir)
    p = user_path(resume)
    if p.is_dir() and not (p / "trainer_state.json").is_file():
        inner = latest(p)  # a run directory was given
        if inner is not None:
            return inner
    if not (p / "trainer_state.json").is_file():
        raise UserError(
            f"{resume} is not a complete checkpoint (no trainer_state.json).",
            field="output.resume",
            fix="give a checkpoints/step-N folder, or --set output.resume=auto",
        )
    return p
