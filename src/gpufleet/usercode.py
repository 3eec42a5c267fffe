"""A user's reward function, `module:function`: imported one way by `gpufleet check` and the trainer.

The module is looked up in the current folder first (as `python -m` does, also for the installed
`gpufleet` command), then on PYTHONPATH. Every way it can fail is one `UserError` on
`reward.functions`: module not found, the module raising while it is imported (the exception and the
file:line in the user's code, not gpufleet's traceback), the name missing, not callable, or a
signature that cannot take `fn(prompts, completions, **columns)`. No torch import here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from gpufleet.errors import UserError

FIELD = "reward.functions"
CALL = "fn(prompts, completions, **columns)"


def import_function(name: str, columns: Sequence[str] | None = None) -> Callable:
    """The callable `name` ("module:function") points at; `columns`: the dataset columns passed by
    keyword (when known, the signature is checked against them too)."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or not attr.isidentifier():
        raise _error(name, "write it as module:function", "e.g. my_rewards:accuracy")
    module = _import(name, module_name)
    where = getattr(module, "__file__", None) or module_name
    if not hasattr(module, attr):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise _error(
            name,
            f"{where} defines no {attr!r}" + (f" (it has {', '.join(sorted(public)[:8])})" if public else ""),
            "check the name: module:function names a function defined in that module",
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise _error(
            name,
            f"{attr!r} in {where} is not a function (it is of type {type(fn).__name__})",
            "name a function",
        )
    _check_signature(name, fn, columns)
    return fn


class RewardImportError(UserError):
    """`why` and `fix` separately, for `gpufleet check`'s report."""

    def __init__(self, why: str, fix: str):
        self.why = why
        super().__init__(why, field=FIELD, fix=fix)


def _error(name: str, why: str, fix: str) -> RewardImportError:
    return RewardImportError(f"reward function {name!r}: {why}.", fix)


def _import(name: str, module_name: str):
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise _error(
                name,
                f"no module {module_name!r} in {here} or on PYTHONPATH",
                f"give module:function with an importable module: run gpufleet from the folder that holds "
                f"{module_name.split('.')[0]}.py, or add that folder to PYTHONPATH",
            ) from None
        raise _import_failed(name, module_name, e) from None
    except SyntaxError as e:
        raise _error(
            name,
            f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}",
            "fix the syntax there",
        ) from None
    except Exception as e:  # the user's module raised while importing: report it as theirs, in one line
        raise _import_failed(name, module_name, e) from None


def _import_failed(name: str, module_name: str, e: BaseException) -> RewardImportError:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    top = module_name.split(".")[0]
    mine = [f for f in frames if Path(f.filename).stem == top or f"/{top}/" in f.filename] or frames
    at = f" at {mine[-1].filename}:{mine[-1].lineno}" if mine else ""
    return _error(
        name,
        f"importing {module_name} raised {type(e).__name__}: {e}{at}",
        "fix the module so that `import "
        + module_name
        + "` works (try python -c 'import "
        + module_name
        + "')",
    )


def _check_signature(name: str, fn: Callable, columns: Sequence[str] | None) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    kwargs = {c: [] for c in columns or ()}
    try:
        sig.bind([], [], **kwargs)
    except TypeError as e:
        has = f"{getattr(fn, '__name__', name)}{sig}"
        extra = f" with the dataset columns {', '.join(columns)}" if columns else ""
        raise _error(
            name,
            f"{has} cannot be called as {CALL}{extra} ({e})",
            "def fn(prompts, completions, **kwargs) -> list[float | None]",
        ) from None
