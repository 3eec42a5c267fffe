"""The user's code a job names: `module:Name` (a module on the import path) or `path/to/file.py:Name` (a
file, what a verl user writes), for reward functions today and environment classes next.

Where modules are looked for, in order: the job file's folder, the working directory, then the
installed packages (sys.path). A file path is relative to the job file's folder when the job file
wrote it, to the working directory when a flag or the environment did (`config.load` anchors it, so
every rank sees the same absolute path). `problem` checks a reference without running the user's code
(`check` must not execute it); `load` imports it and turns the user's mistakes into one line that points
at the user's file, not at gpufleet's.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

from gpufleet.errors import UserError


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
    """The folders searched before sys.path: the job file's folder, then the working directory."""
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


def source_file(ref: str, folders: Iterable[str]) -> tuple[Path | None, str | None]:
    """(the .py file that defines the reference's module, None) or (None, why it cannot be found)."""
    where, name = split(ref)
    if not where or not name.isidentifier():
        return None, "write it as module:Name or path/to/file.py:Name"
    if is_file(where):
        path = Path(where)
        if not path.is_file():
            return None, f"{path} does not exist" if not path.exists() else f"{path} is not a file"
        return path, None
    top = where.split(".")[0]
    if not all(part.isidentifier() for part in where.split(".")):
        return None, f"{where!r} is not a module name; for a file write path/to/file.py:{name}"
    spec = importlib.machinery.PathFinder.find_spec(top, [*folders, *sys.path])
    if spec is None:
        looked = ", ".join(folders)
        return None, f"no module {top!r} in {looked} or the installed packages"
    if where != top:
        try:
            spec = importlib.util.find_spec(where)  # a submodule: its package must be importable here
        except (ImportError, ValueError) as e:
            return None, f"module {where!r} cannot be found ({e})"
        if spec is None:
            return None, f"package {top!r} has no module {where[len(top) + 1 :]!r}"
    origin = spec.origin
    return (Path(origin), None) if origin and origin.endswith(".py") else (None, None)


def defined_names(path: Path) -> tuple[dict[str, ast.AST], str | None]:
    """Top-level names a Python file defines (functions, classes, assignments, imports), read not run."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        return {}, f"{path}:{e.lineno}: syntax error ({e.msg})"
    except (OSError, UnicodeDecodeError) as e:
        return {}, f"{path} cannot be read ({e})"
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names, None


def problem(ref: str, folders: Iterable[str]) -> tuple[str | None, ast.AST | None]:
    """(why `ref` cannot be loaded, None) or (None, its definition when it could be read); runs nothing."""
    folders = list(folders)
    path, why = source_file(ref, folders)
    if why or path is None:
        return why, None
    names, why = defined_names(path)
    if why:
        return why, None
    name = split(ref)[1]
    if name not in names:
        close = difflib.get_close_matches(name, [n for n in names if not n.startswith("_")], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{path} defines no {name!r}{hint}", None
    return None, names[name]


def load(ref: str, folders: Iterable[str], field: str) -> object:
    """Import `ref` and return the object; a user's mistake becomes one UserError naming `field`."""
    where, name = split(ref)
    use_roots(folders)
    try:
        module = _module_from_file(Path(where)) if is_file(where) else importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # the user's module raised while being imported
        raise UserError(
            f"{ref}: importing it raised {_user_frame(e)}{type(e).__name__}: {e}",
            field=field,
            fix="fix the error in that file (python -c 'import <module>' shows the whole traceback)",
        ) from None
    if not hasattr(module, name):
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=1)
        raise UserError(
            f"{ref}: {where} has no {name!r}.",
            field=field,
            fix=f"did you mean {where}:{close[0]}?" if close else "check the name after the colon",
        )
    return getattr(module, name)


def _module_from_file(path: Path) -> ModuleType:
    """Import a .py file by path once per process (its folder goes on sys.path for its own imports)."""
    path = path.resolve()
    key = f"gpufleet_user.{abs(hash(str(path)))}.{path.stem}"
    if key in sys.modules:
        return sys.modules[key]
    if not path.is_file():
        raise UserError(f"{path} does not exist.", fix="give the path of a .py file")
    use_roots([str(path.parent)])
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def _user_frame(e: BaseException) -> str:
    """'file.py:LINE: ' of the deepest frame outside Python's import machinery ('' if none)."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if "importlib" not in f.filename and not f.filename.endswith("imports.py")
    ]
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}: "
    return f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
