"""File-system faults as the user's problem: a full disk, a quota, a file system that became read-only
or a folder whose permissions changed while gpufleet was writing. `fault_error` turns such an OSError
(wherever it was raised: metrics, samples, the final model, the run folder) into one `UserError` naming
the mount point and the file; the CLI and every rank's worker use it, so the user reads one line and
exit code 2 instead of a traceback. Checkpoints have their own, richer message (gpufleet.checkpoint).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from gpufleet.errors import UserError

FULL = (errno.ENOSPC, errno.EDQUOT)
DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


def disk_full(e: BaseException) -> bool:
    """ENOSPC, however the writer reports it (torch.save's zip writer says "unexpected pos")."""
    if isinstance(e, OSError) and e.errno in FULL:
        return True
    text = str(e)
    return "No space left" in text or "unexpected pos" in text or "file write failed" in text


def device_of(path: Path) -> str:
    """The mount point holding `path` (what `df` would name)."""
    p = Path(os.path.abspath(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def fault_error(e: BaseException) -> UserError | None:
    """The one-line error for a file-system fault met while writing; None for anything else."""
    if not isinstance(e, OSError) or e.errno not in FULL + DENIED:
        return None
    path = Path(str(e.filename)) if e.filename else _written_file(e)
    if path is None:
        return None
    where = device_of(path.parent if not path.exists() else path)
    if e.errno in FULL:
        free = shutil.disk_usage(where).free
        return UserError(
            f"no space left on {where} writing {path} ({free / 2**20:.1f} MiB free).",
            field="output.dir",
            fix="free space there (or --set output.dir=<a disk with room>), then run the same command "
            "again: it resumes from the last checkpoint",
        )
    why = "the file system is read-only" if e.errno == errno.EROFS else "permission denied"
    return UserError(
        f"cannot write {path}: {why} (on {where}).",
        field="output.dir",
        fix="make that folder writable (or --set output.dir=<a writable folder>), then run again",
    )


def _written_file(e: BaseException) -> Path | None:
    """The file being written when a write (not an open) failed: such an OSError names no file, so take
    the innermost frame's open file object (`f` in `Path.write_text`) or path."""
    tb, frames = e.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_locals)
        tb = tb.tb_next
    for local in reversed(frames):
        for v in local.values():
            name = getattr(v, "name", None)
            if hasattr(v, "write") and isinstance(name, str) and os.path.isabs(name):
                return Path(name)
        for v in local.values():
            if isinstance(v, Path):
                return v.absolute()
    return None


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a reader sees the old file or the new one): a temporary file
    beside it, then a rename; the folder is made if needed. On a failure (a full disk) nothing is left
    behind and the OSError goes on (`fault_error` words it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
