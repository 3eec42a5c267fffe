"""`gpufleet export RUN_DIR [--step N] --to DIR`: a model folder that from_pretrained (and vLLM) load."""

from __future__ import annotations

from pathlib import Path

from gpufleet.checkpoint import export


def export_command(run_dir: str, step: int | None, to: str) -> int:
    src = export(Path(run_dir).expanduser(), Path(to).expanduser(), step)
    print(f"exported {src} -> {to}")
    print(f"  load it with: AutoModelForCausalLM.from_pretrained({to!r})")
    return 0
