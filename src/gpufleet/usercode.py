"""The user's code a job names: a reward function as `module:function` or `path/to/file.py:function` (what
a verl user writes), imported one way by `gpufleet check` and the trainer.

Modules are looked up in the job file's folder, then the working directory (also for the installed
`gpufleet` command), then PYTHONPATH; the launcher puts the same folders first on every rank's
PYTHONPATH. A file path is relative to the job file's folder when the job file wrote it, to the working
directory when a flag did (`config.load` makes it absolute, so every rank sees the same file). Every way
it can fail is one `UserError` on `reward.functions`: module not found, the module raising while it is
imported (the exception and the file:line in the user's code, not gpufleet's traceback), the name
missing, not callable, or a signature that cannot take `fn(prompts, completions, **columns)`.
No torch import here.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from gpufleet.errors import UserError

FIELD = "reward.functions"
CALL = "fn(prompts, completions, **columns)"


def split(ref: str) -> tuple[str, str]:
    """`where:Name` -> (where, Name); the last colon separates them."""
    where, _, name = ref.rpartition(":")
    return where, name


def is_file(where: str) -> bool:
    """A file path (`rewards/my.py`, `./my.py`), not a dotted module name."""
    return where.endswith(".py") or "/" in where or os.sep in where


def anchored(ref: str, base: Path) -> str:
    """A file reference made absolute against `base`; a module reference unchanged."""
    where, name = split(ref)
    if not is_file(where):
        return ref
    return f"{(base / Path(where).expanduser()).resolve()}:{name}"


def roots(job_path: Path | None) -> list[str]:
    """The folders searched before PYTHONPATH: the job file's folder, then the working directory."""
    out = [str(job_path.resolve().parent)] if job_path is not None else []
    cwd = os.getcwd()
    return out + ([cwd] if cwd not in out else [])


def use_roots(folders: Iterable[str]) -> None:
    """Put the search folders first on this process's import path (idempotent)."""
    for folder in reversed(list(folders)):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)


def pythonpath(folders: Iterable[str], env: Mapping[str, str]) -> str:
    """PYTHONPATH for child processes (torchrun ranks): the search folders, then what was there."""
    parts = [*folders, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return os.pathsep.join(dict.fromkeys(parts))


def import_function(
    name: str, columns: Sequence[str] | None = None, folders: Sequence[str] | None = None
) -> Callable:
    """The callable `name` (`module:function` or `file.py:function`) points at; `columns`: the dataset
    columns passed by keyword (when known, the signature is checked against them too); `folders`: where
    modules are looked for first (default: the working directory)."""
    module_name, attr = split(name)
    if not module_name or not attr or not attr.isidentifier():
        raise _error(
            name, "write it as module:function or path/to/file.py:function", "e.g. my_rewards:accuracy"
        )
    if not is_file(module_name) and not all(p.isidentifier() for p in module_name.split(".")):
        raise _error(
            name,
            f"{module_name!r} is neither a module name nor a .py file",
            f"write module:function (my_rewards:{attr}) or path/to/file.py:{attr}",
        )
    folders = list(folders) if folders is not None else [os.getcwd()]
    use_roots(folders)
    module = (
        _from_file(name, Path(module_name)) if is_file(module_name) else _import(name, module_name, folders)
    )
    where = getattr(module, "__file__", None) or module_name
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, public, n=1)
        raise _error(
            name,
            f"{where} defines no {attr!r}" + (f" (it has {', '.join(public[:8])})" if public else ""),
            f"did you mean {module_name}:{close[0]}?"
            if close
            else "check the name: module:function names a function defined in that module",
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


def _from_file(name: str, path: Path):
    """Import a .py file by path once per process (its folder goes first on sys.path for its imports)."""
    if not path.is_file():
        raise _error(
            name,
            f"{path} does not exist" if not path.exists() else f"{path} is not a file",
            "give the path of a .py file",
        )
    path = path.resolve()
    key = f"gpufleet_user_{abs(hash(str(path)))}_{path.stem}"
    if key in sys.modules:
        return sys.modules[key]
    use_roots([str(path.parent)])
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[key]
        raise _error(name, f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}", "fix the syntax there") from None
    except Exception as e:
        del sys.modules[key]
        raise _import_failed(name, path.stem, e) from None
    return module


def _import(name: str, module_name: str, folders: list[str]):
    here = ", ".join(folders)
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
