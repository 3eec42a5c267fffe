"""Checkpoints that survive anything: atomic save, exact resume, export.

Layout of RUN_DIR/checkpoints/step-N/ (a Hugging Face model folder plus the training state):

    model.safetensors, config.json, tokenizer files   the unwrapped policy (gathered from FSDP shards)
    optimizer.pt        AdamW state keyed by parameter name (full, so any rank count can load it)
    trainer_state.json  step, LR-scheduler state, world layout, what continuity needs
    rng-rank<R>.pt      python / numpy / torch (and CUDA) RNG states of every rank
    batch-rank<R>.pt    the generation batch, when saved in the middle of reusing one
    job.yaml            the resolved job

Atomic: every rank writes into checkpoints/.tmp-step-N, each file is fsync'd, then rank 0 renames
the folder to step-N, fsyncs the parent, and only then replaces the `latest` pointer (a small file
written and renamed the same way). A kill at any moment leaves either the old or the new checkpoint
complete, never a `latest` naming a partial one. Loading uses safetensors and
`torch.load(weights_only=True)` only: no pickled code runs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from gpufleet.ckptindex import (  # noqa: F401  (re-exported: callers import them from here)
    LATEST,
    STEP_PREFIX,
    TrainingState,
    complete_steps,
    latest,
    load_state,
    resolve_resume,
)
from gpufleet.errors import UserError
from gpufleet.fsfaults import device_of, disk_full


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def readable_by_all(folder: Path) -> None:
    """Give every file in `folder` the mode a plain `open()` would (0644 under the usual umask 022):
    safetensors writes 0600, which a serving account on a shared cluster cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def _slow_hook() -> None:
    """Test-only: GPUFLEET_TEST_SLOW_SAVE=<seconds> pauses between files, to land kills mid-write."""
    delay = float(os.environ.get("GPUFLEET_TEST_SLOW_SAVE", "0") or 0)
    if delay:
        time.sleep(delay)


# ------------------------------------------------------------------------------------------ save


REFERENCE_FILE = "reference.safetensors"
"""A synced reference model's weights (algorithm.sync_ref_model)."""


def rng_state() -> dict[str, Any]:
    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].copy()),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    run_dir: Path,
    step: int,
    *,
    policy,
    model_state,
    tokenizer,
    optim_state,
    scheduler,
    layout: dict,
    job_yaml: str,
    rt,
    batch: dict | None,
    keep_last: int,
    controllers: dict | None = None,
    reference_state: dict | None = None,
) -> Path:
    """Write checkpoint `step` atomically (every policy rank calls this; rank 0 commits it)."""
    import torch.distributed as dist

    root = run_dir / "checkpoints"
    tmp = root / f".tmp-{STEP_PREFIX}{step}"
    final = root / f"{STEP_PREFIX}{step}"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(rt)
    with _no_partial(tmp, run_dir, rt):
        torch.save(rng_state(), tmp / f"rng-rank{rt.rank}.pt")
        _fsync_file(tmp / f"rng-rank{rt.rank}.pt")
        if batch is not None:
            torch.save(batch, tmp / f"batch-rank{rt.rank}.pt")
            _fsync_file(tmp / f"batch-rank{rt.rank}.pt")
        if rt.is_main:
            policy.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            _slow_hook()
            torch.save(optim_state, tmp / "optimizer.pt")
            _slow_hook()
            (tmp / "job.yaml").write_text(job_yaml, encoding="utf-8")
            _write_state(tmp, step, scheduler, layout, controllers, reference_state)
            readable_by_all(tmp)
            for f in tmp.iterdir():
                _fsync_file(f)
            _fsync_dir(tmp)
    _barrier(rt)
    if rt.is_main:
        if final.exists():  # a checkpoint of this step from an earlier attempt: replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        pointer_tmp = root / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name, encoding="utf-8")
        _fsync_file(pointer_tmp)
        os.replace(pointer_tmp, root / LATEST)
        _fsync_dir(root)
        for old in complete_steps(run_dir)[:-keep_last]:
            shutil.rmtree(root / f"{STEP_PREFIX}{old}", ignore_errors=True)
    if rt.distributed and dist.is_initialized():
        _barrier(rt)
    return final


@contextlib.contextmanager
def _no_partial(tmp: Path, run_dir: Path, rt):
    """A failed write leaves no partial checkpoint behind (it would keep a full disk full); a full disk
    becomes one line naming the device, the folder, what a checkpoint needs and what is free."""
    try:
        yield
    except BaseException as e:
        written = sum(f.stat().st_size for f in tmp.glob("*") if f.is_file()) if tmp.exists() else 0
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(
                f"cannot write the checkpoint {tmp}: {e.strerror} (the disk became read-only or the "
                "folder's permissions changed while training).",
                field="output.dir",
                fix="make output.dir writable again, then run the same command to resume",
            ) from None
        if not isinstance(e, (OSError, RuntimeError)) or not disk_full(e):
            raise
        prev = latest(run_dir)
        need = sum(f.stat().st_size for f in prev.iterdir() if f.is_file()) if prev else written
        free = shutil.disk_usage(run_dir).free
        raise UserError(
            f"no space left on {device_of(run_dir)} writing {tmp} (a checkpoint needs ~{need / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free); the partial checkpoint was removed"
            + (f" and {prev} is intact." if prev else "."),
            field="output.dir",
            fix="free space there (or lower output.keep_last), then run the same command again to resume",
        ) from None


def _barrier(rt) -> None:
    import torch.distributed as dist

    if rt.distributed and dist.is_initialized():
        dist.barrier(group=rt.policy_group)


# ------------------------------------------------------------------------------------------ load


def load_optimizer(path: Path) -> dict:
    return torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)


def _write_state(tmp: Path, step: int, scheduler, layout, controllers, reference_state) -> None:
    """trainer_state.json (step, scheduler, layout, controllers) and a synced reference's weights."""
    if reference_state is not None:  # a synced (moving) reference: TR-DPO
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().clone() for k, v in reference_state.items()}, tmp / REFERENCE_FILE)
    state = {"step": step, "scheduler": scheduler, "layout": layout, "time": time.time()}
    state["controllers"] = controllers or {}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2), encoding="utf-8")


def load_reference(path: Path) -> dict | None:
    """The synced reference model's weights a checkpoint holds, or None."""
    f = path / REFERENCE_FILE
    if not f.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(f)


def load_rng(path: Path, rank: int) -> dict | None:
    f = path / f"rng-rank{rank}.pt"
    return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None


def load_batch(path: Path, rank: int) -> dict | None:
    f = path / f"batch-rank{rank}.pt"
    return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None


# ---------------------------------------------------------------------------------------- export


def require_empty(to: Path) -> None:
    """`--to` must be a new or empty folder: an export never writes over anything."""
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UserError(f"{to} exists and is not empty.", field="--to", fix="give a new or empty folder")


def export(run_dir: Path, to: Path, step: int | None = None) -> Path:
    """Copy a checkpoint's (or the final) model folder to `to`: loadable by from_pretrained and vLLM."""
    if step is None:
        final = run_dir / "final"
        whole = (final / "config.json").is_file() or (final / "adapter_config.json").is_file()
        src = final if whole else latest(run_dir)
        if src is None:
            raise UserError(
                f"{run_dir} holds no final model and no complete checkpoint.",
                field="RUN_DIR",
                fix="point at a run directory written by gpufleet train",
            )
    else:
        src = run_dir / "checkpoints" / f"{STEP_PREFIX}{step}"
        if not (src / "trainer_state.json").is_file():
            have = ", ".join(map(str, complete_steps(run_dir))) or "none"
            raise UserError(
                f"no complete checkpoint for step {step} in {run_dir} (complete: {have}).",
                field="--step",
                fix="pick one of the complete steps",
            )
    require_empty(to)
    copy_model(src, to)
    return src


def copy_model(src: Path, to: Path) -> None:
    """The model folder inside checkpoint (or final) `src`, copied to `to`: the training state left out."""
    to.mkdir(parents=True, exist_ok=True)
    skip = {"optimizer.pt", "trainer_state.json"}
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not f.name.startswith(("rng-rank", "batch-rank")):
            shutil.copy2(f, to / f.name)
    readable_by_all(to)
