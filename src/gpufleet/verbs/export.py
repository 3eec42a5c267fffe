"""`gpufleet export RUN_DIR [--step N] --to DIR [--merge]`: a model folder that from_pretrained (and vLLM)
load; for a LoRA run the adapter folder (PeftModel.from_pretrained), or with --merge base + adapter as
one model."""

from __future__ import annotations

import tempfile
from pathlib import Path

from gpufleet.checkpoint import export, require_empty
from gpufleet.errors import UserError
from gpufleet.models import lora
from gpufleet.paths import user_path


def export_command(run_dir: str, step: int | None, to: str, merge: bool = False) -> int:
    dest = user_path(to)
    _outside_what_train_replaces(user_path(run_dir), dest, to)
    if not merge:
        src = export(user_path(run_dir), dest, step)
        print(f"exported {src} -> {to}")
        if lora.is_adapter(dest):
            print(f"  a LoRA adapter: PeftModel.from_pretrained(base, {to!r}); --merge writes one model")
        else:
            print(f"  load it with: AutoModelForCausalLM.from_pretrained({to!r})")
        return 0
    require_empty(dest)
    with tempfile.TemporaryDirectory(prefix="gpufleet-export-") as tmp:
        adapter = Path(tmp) / "adapter"
        src = export(user_path(run_dir), adapter, step)
        if not lora.is_adapter(adapter):
            raise UserError(
                f"{src} holds a whole model, not a LoRA adapter: there is nothing to merge.",
                field="--merge",
                fix="drop --merge",
            )
        lora.merged(adapter, lora.base_of(adapter), dest, _min_new_tokens(src, user_path(run_dir)))
    print(f"exported {src} merged with its base -> {to}")
    print(f"  load it with: AutoModelForCausalLM.from_pretrained({to!r})")
    return 0


def _outside_what_train_replaces(run: Path, dest: Path, to: str) -> None:
    """--to inside the run's final/ or checkpoints/ would be deleted by the run's next resume or save."""
    for part in ("final", "checkpoints"):
        owned = (run / part).resolve()
        if dest.resolve() == owned or owned in dest.resolve().parents:
            raise UserError(
                f"{to} is inside {run / part}, which train replaces when the run goes on (resume, save).",
                field="--to",
                fix=f"export outside it, e.g. --to {run.name}-model",
            )


def _min_new_tokens(src: Path, run_dir: Path) -> int:
    """rollout.min_completion_length of the job that trained `src` (its job.yaml, else the run's): the
    merged model's generation config keeps it, as a trained model's does (0 when neither says)."""
    import yaml

    for job in (src / "job.yaml", run_dir / "job.yaml"):
        try:
            data = yaml.safe_load(job.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            continue
        rollout = data.get("rollout") if isinstance(data, dict) else None
        if isinstance(rollout, dict):
            return int(rollout.get("min_completion_length") or 0)
    return 0
