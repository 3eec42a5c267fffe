"""The user's code a job names: a reward function as `module:function` or `path/to/file.py:function` (what
a verl user writes), or an environment class as `module:Class`, imported one way by `gpufleet check`
and the trainer.

Modules are looked up in the job file's folder, then the working directory (also for the installed
`gpufleet` command), then PYTHONPATH; the launcher puts the same folders first on every rank's
PYTHONPATH. A file path is relative to the job file's folder when the job file wrote it, to the working
directory when a flag did (`config.load` makes it absolute, so every rank sees the same file). Every way
it can fail is one `UserError` on `reward.functions`: module not found, the module raising while it is
imported (the exception and the file:line in the user's code, not gpufleet's traceback), the name
missing, not callable, or a signature that cannot take the call TRL 1.16's GRPOTrainer makes and
`call_reward` makes here: every argument by keyword, `fn(prompts=, completions=, completion_ids=,
**columns)` (`reward_columns`: which data columns). `import_object` is the same for any named callable,
reporting on the field the caller names. No torch import here.
"""

from __future__ import annotations

import asyncio
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
from gpufleet.paths import user_path
from gpufleet.watchdog import HEARTBEAT_EVERY, Overdue, deadline, where_stuck

FIELD = "reward.functions"
PASSED = ("prompts", "completions", "completion_ids")
"""The keywords every reward function gets besides the data's columns (TRL 1.16's names)."""
CALL = "fn(prompts=..., completions=..., completion_ids=..., **columns)"
LOGGING = ("trainer_state", "log_metric", "log_extra")
"""TRL 1.16's keywords for the training state and logging from a reward: passed to a function that
takes them (a parameter of that name, or **kwargs), as TRL passes them (`rl/rewardlog.RewardLog`)."""
TRL_ONLY = ("environments",)
"""Keywords TRL 1.16 passes too and gpufleet does not."""


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
    return f"{(base / user_path(where)).resolve()}:{name}"


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


def reward_columns(names: Iterable[str], prompt_field: str = "prompt") -> list[str]:
    """The data columns (of `names`, in order) a reward function receives by keyword: every one but the
    prompt's, as TRL (which leaves out `prompt`, `completion` and `completion_ids`), and none that would
    clash with a keyword of `PASSED` or `LOGGING` (TRL's trainer_state replaces such a column too).
    `gpufleet check` and the trainer both bind rewards with these."""
    skip = {prompt_field, "prompt", "completion", *PASSED, *LOGGING}
    return [c for c in names if c not in skip]


def call_reward(
    fn: Callable,
    prompts: Sequence,
    completions: Sequence,
    completion_ids: Sequence | None,
    columns: Mapping[str, Sequence],
    logging: Mapping[str, object] | None = None,
):
    """Call one reward function as TRL 1.16's GRPOTrainer does: every argument by keyword,
    `fn(prompts=, completions=, completion_ids=, **columns)` (`columns` from `reward_columns`), and of
    `logging` (`LOGGING` keywords) what the function takes. An `async def` function (or one returning an
    awaitable) is run to completion, as TRL awaits it."""
    extra = {k: logging[k] for k in _taken(fn, logging or ())}  # looked up only when taken
    out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    return out


def _taken(fn: Callable, keywords: Iterable[str]) -> list[str]:
    """Those of `keywords` that `fn` takes: a parameter of that name, or **kwargs (all of them; so too
    where its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return list(keywords)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return list(keywords)
    named = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
    return [k for k in keywords if k in named]


async def _awaited(awaitable):
    return await awaitable


def import_function(
    name: str,
    columns: Sequence[str] | None = None,
    folders: Sequence[str] | None = None,
    timeout: float | None = None,
    passes: Sequence[str] = (),
) -> Callable:
    """The reward function `name` (`module:function` or `file.py:function`) points at, its signature
    checked against `call_reward`'s call; `columns`: the data columns passed by keyword (`reward_columns`;
    None when they cannot be known: then a parameter the call does not fill may still be a column);
    `folders`: where modules are looked for first (default: the working directory); `timeout`: seconds
    the import may take (reward.timeout); `passes`: the keywords of TRL_ONLY this job passes (to the
    functions that take them, as LOGGING's)."""
    fn = import_object(name, folders, timeout=timeout)
    _check_signature(name, fn, columns, passes)
    return fn


def import_object(
    name: str,
    folders: Sequence[str] | None = None,
    *,
    field: str = FIELD,
    what: str = "reward function",
    example: str = "my_rewards:accuracy",
    form: str = "function",
    timeout: float | None = None,
    dicts: bool = False,
) -> Callable:
    """The callable `name` (`module:Name` or `file.py:Name`) points at (or a dict, with `dicts`: TRL's
    dict form of environment_factory); every failure is one `RewardImportError` on `field` that calls
    the object `what`; an import running past `timeout` seconds is one too (see gpufleet.watchdog)."""
    err = _errors(name, field, what, form)
    module_name, attr = split(name)
    if not module_name or not attr or not attr.isidentifier():
        raise err(f"write it as module:{form} or path/to/file.py:{form}", f"e.g. {example}")
    if not is_file(module_name) and not all(p.isidentifier() for p in module_name.split(".")):
        raise err(
            f"{module_name!r} is neither a module name nor a .py file",
            f"write module:{form} (mymodule:{attr}) or path/to/file.py:{attr}",
        )
    folders = list(folders) if folders is not None else [os.getcwd()]
    use_roots(folders)
    try:
        with deadline(f"importing {module_name}", timeout, first=HEARTBEAT_EVERY):  # imports may be slow
            module = (
                _from_file(err, Path(module_name))
                if is_file(module_name)
                else _import(err, module_name, folders)
            )
    except Overdue as e:
        at = where_stuck(e)
        raise err(
            f"importing {module_name} did not finish within {timeout:g} s (reward.timeout)"
            + (f"; it was at {at}" if at else ""),
            "move slow work out of module level (load lazily on first call), or raise reward.timeout",
        ) from None
    where = getattr(module, "__file__", None) or module_name
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, public, n=1)
        raise err(
            f"{where} defines no {attr!r}" + (f" (it has {', '.join(public[:8])})" if public else ""),
            f"did you mean {module_name}:{close[0]}?"
            if close
            else f"check the name: module:{form} names a {form} defined in that module",
        )
    fn = getattr(module, attr)
    if not callable(fn) and not (dicts and isinstance(fn, dict)):
        raise err(
            f"{attr!r} in {where} is not {'a function' if form == 'function' else 'callable'} (it is of type {type(fn).__name__})",
            f"name a {what}",
        )
    return fn


class RewardImportError(UserError):
    """`why` and `fix` separately, for `gpufleet check`'s report."""

    def __init__(self, why: str, fix: str, field: str = FIELD):
        self.why = why
        super().__init__(why, field=field, fix=fix)


def _errors(name: str, field: str, what: str, form: str = "function") -> Callable:
    """`err(why, fix)`: the error about the object `name` on `field`."""

    def err(why: str, fix: str) -> RewardImportError:
        return RewardImportError(
            f"{what} {name!r}: {why}.", fix.replace("module:Name", f"module:{form}"), field
        )

    return err


def _error(name: str, why: str, fix: str) -> RewardImportError:
    return _errors(name, FIELD, "reward function")(why, fix)


def _from_file(err, path: Path):
    """Import a .py file by path once per process (its folder goes first on sys.path for its imports)."""
    if not path.is_file():
        raise err(
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
    except BaseException as e:
        del sys.modules[key]
        if isinstance(e, SyntaxError):
            raise err(f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}", "fix the syntax there") from None
        if isinstance(e, (Exception, SystemExit)):
            raise _import_failed(err, path.stem, e) from None
        raise
    return module


def _import(err, module_name: str, folders: list[str]):
    here = f"in {', '.join(folders)} or " if folders else ""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise err(
                f"no module {module_name!r} {here}on PYTHONPATH",
                f"give module:Name with an importable module: run gpufleet from the folder that holds "
                f"{module_name.split('.')[0]}.py, or add that folder to PYTHONPATH",
            ) from None
        raise _import_failed(err, module_name, e) from None
    except SyntaxError as e:
        raise err(
            f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}",
            "fix the syntax there",
        ) from None
    except (Exception, SystemExit) as e:  # the user's module raised while importing: theirs, in one line
        raise _import_failed(err, module_name, e) from None


def _import_failed(err, module_name: str, e: BaseException) -> RewardImportError:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    top = module_name.split(".")[0]
    mine = [f for f in frames if Path(f.filename).stem == top or f"/{top}/" in f.filename] or frames
    at = f" at {mine[-1].filename}:{mine[-1].lineno}" if mine else ""
    if isinstance(e, SystemExit):
        return err(
            f"importing {module_name} called sys.exit({e.code!r}){at}",
            "do not exit at import: put that code under `if __name__ == '__main__':`",
        )
    return err(
        f"importing {module_name} raised {type(e).__name__}: {e}{at}",
        "fix the module so that `import "
        + module_name
        + "` works (try python -c 'import "
        + module_name
        + "')",
    )


def _check_signature(
    name: str, fn: Callable, columns: Sequence[str] | None, passes: Sequence[str] = ()
) -> None:
    """Refuse, in one line naming the parameter and the fix, a signature `call_reward` cannot call (TRL
    1.16 could not either, short of the keywords of TRL_ONLY, which gpufleet does not pass)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    problem = _unbindable(getattr(fn, "__name__", None) or split(name)[1], sig, columns, passes)
    if problem is not None:
        raise _error(name, *problem)


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _unbindable(
    label: str, sig: inspect.Signature, columns: Sequence[str] | None, passes: Sequence[str] = ()
) -> tuple[str, str] | None:
    """(why, fix) when `sig` cannot take the keywords `call_reward` passes; None when it can. With
    `columns` None (the data could not be read) a required parameter is not refused: it may be a column."""
    given = [*PASSED, *(columns or ())]
    params = list(sig.parameters.values())
    has = f"{label}{sig}"
    rest = ", ".join(str(p.replace(annotation=p.empty)) for p in params if p.kind is not p.VAR_KEYWORD)
    with_kwargs = f"def {label}({rest + ', ' if rest else ''}**kwargs)"
    keywordable = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if only:
        return (
            f"{has} has positional-only parameters ({_quoted(only)}, before '/'), but rewards are called "
            f"by keyword, as TRL does: {CALL}",
            f"remove the '/' from the def of {label}",
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [k for k in given if k not in keywordable]
        if unknown:
            return (
                f"{has} has no parameter for {_quoted(unknown)}, which gpufleet passes by keyword, as TRL "
                f"does: {CALL}" + (f" with the data's columns {', '.join(columns)}" if columns else ""),
                f"add **kwargs: {with_kwargs}",
            )
    if columns is not None:
        taken = [*given, *LOGGING, *passes]
        missing = [n for n, p in keywordable.items() if p.default is p.empty and n not in taken]
        if missing:
            first = missing[0]
            why = (
                f"TRL's {first!r}, which gpufleet does not pass to this job"
                if first in TRL_ONLY
                else f"{first!r}, which is not a column of the data (its columns: "
                f"{', '.join(columns) or 'none besides the prompt'})"
            )
            fix = (
                f"drop the parameter and read kwargs.get({first!r}): gpufleet passes it for a TRL "
                f"environment class run in the trainer only (--set env.servers=0 where env.name is one)"
                if first in TRL_ONLY
                else f"add a {first!r} column to the data, or give the parameter a default ({first}=None)"
            )
            return f"{has} needs the argument {why}; it gets {CALL}", fix
    try:  # whatever the cases above missed
        logging = [k for k in (*LOGGING, *passes) if k in keywordable]
        (sig.bind if columns is not None else sig.bind_partial)(**dict.fromkeys([*given, *logging]))
    except TypeError as e:
        return f"{has} cannot be called as {CALL} ({e})", f"write it as {with_kwargs}"
    return None


def tool_failure(name: str, e: BaseException) -> str:
    """A failed tool call's error text: TRL's (`str(e)`); a tool that called sys.exit is said as such (its
    result, like any failure's: with TRL it would end the run)."""
    return f"tool {name} called sys.exit({e.code!r})" if isinstance(e, SystemExit) else str(e)
