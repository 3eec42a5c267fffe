"""Paths as the user writes them: ``~`` and ``~user`` expanded as the shell does.

``pathlib.Path.expanduser`` raises RuntimeError for a ``~name`` whose user does not exist (a job file's
``model.path: ~0`` would end ``gpufleet check`` in a traceback); ``os.path.expanduser`` leaves such a
path as it is, and the checks then say it does not exist.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["user_path"]


def user_path(value: str | os.PathLike) -> Path:
    """``value`` with ``~`` / ``~user`` expanded where that user exists, else as written."""
    return Path(os.path.expanduser(os.fspath(value)))
