"""Resolve a job from its layers and remember where every value came from.

Layers, lowest to highest: built-in defaults < job file < Slurm (inside a multi-node srun step:
launch.nnodes / node_rank / rdzv_endpoint, see gpufleet.slurm) < environment
`GPUFLEET_<SECTION>__<FIELD>` < flags `--set section.field=value`. Then `algorithm.name` fills the
algorithm fields still unset (source "preset"), and `train.micro_batch` unset becomes
`train.per_device_batch` (source "derived").

Bad values do not stop resolution: each one becomes a `Problem` and the field falls back to the next
lower layer, so `gpufleet check` can report every problem at once. Only an unreadable job file
raises `UserError` straight away.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpufleet.config.layers import env_layer, file_layer, flag_layer, slurm_layer
from gpufleet.config.presets import PRESETS
from gpufleet.config.problems import DEFAULT, FieldRef, Problem, Source, format_value
from gpufleet.config.schema import SECTIONS, Job
from gpufleet.paths import user_path


@dataclass
class Resolved:
    """A resolved job, the source of each `section.field`, and the problems met while resolving."""

    job: Job
    sources: dict[str, Source]
    problems: list[Problem] = field(default_factory=list)
    job_path: Path | None = None

    def value(self, path: str) -> Any:
        section, name = path.split(".", 1)
        return getattr(getattr(self.job, section), name)

    def source(self, path: str) -> Source:
        return self.sources.get(path, DEFAULT)

    def ref(self, path: str) -> FieldRef:
        return FieldRef(path, self.value(path), self.source(path))

    def set_fields(self, section: str) -> list[str]:
        """The fields of `section` a layer set (the job file, Slurm, the environment, a flag), not defaults."""
        paths = (f"{section}.{name}" for name in SECTIONS[section].model_fields)
        return [p for p in paths if self.source(p).kind in ("file", "slurm", "env", "flag")]

    @property
    def origin(self) -> str | None:
        """Where the job file's values came from: its path, `<stdin>` or the pipe it was read from."""
        if self.job_path is not None:
            return str(self.job_path)
        files = (s.detail.rsplit(":", 1)[0] for s in self.sources.values() if s.kind == "file" and s.detail)
        return next(files, None)


def load_job(
    job_path: str | os.PathLike | None,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    anchor: bool = True,
) -> Resolved:
    """Resolve defaults < file < Slurm < env < flags into a `Resolved` job (see the module docstring).
    `anchor=False`: the file is a job gpufleet already resolved (the run's job.yaml a torchrun worker
    reads): its paths are final (the job file's made absolute, a flag's relative to the working directory,
    which the ranks share with the launcher), not relative to the file's folder again. A job given as a
    stream (`-` for stdin, a pipe such as `<(envsubst < job.yaml)`: `read_stream`) has no folder: its relative
    paths are the working directory's, and `job_path` is None."""
    env = os.environ if env is None else env
    problems: list[Problem] = []
    layers: list[dict[str, tuple[Any, Source]]] = []  # lowest first
    path = Path(job_path) if job_path is not None else None
    stream = read_stream(str(job_path)) if job_path is not None else None
    if stream is not None:  # a pipe or stdin: its relative paths are the working directory's
        layers.append(file_layer(*stream[:1], problems, stream[1]))
        path = None
    elif path is not None:
        layers.append(file_layer(path, problems))
    layers.append(slurm_layer(env, problems))
    layers.append(env_layer(env, problems))
    layers.append(flag_layer(sets, problems))

    sources: dict[str, Source] = {}
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        # Candidates per field, highest layer first.
        candidates: dict[str, list[tuple[Any, Source]]] = {}
        for layer in reversed(layers):
            for key, (value, src) in layer.items():
                sec, fld = key.split(".", 1)
                if sec == name:
                    candidates.setdefault(fld, []).append((value, src))
        sections[name], chosen = _validate_section(name, cls, candidates, problems)
        sources.update({f"{name}.{f}": src for f, src in chosen.items()})

    job = Job(**sections)
    resolved = Resolved(job=job, sources=sources, problems=problems, job_path=path)
    _apply_presets(resolved)
    if stream is not None and anchor:
        _anchor_paths(resolved, Path.cwd())
    elif path is not None and anchor:
        _anchor_paths(resolved, path.resolve().parent)
    return resolved


STDIN = "-"
"""The job path that means standard input (`envsubst < job.yaml | gpufleet check -`, as `kubectl apply -f -`)."""

_STREAMS: dict[tuple[int, int], str] = {}
"""Pipes already read by this process, by (device, inode): a pipe can be read once, and `check` of a launch
job loads the job twice."""


def read_stream(job_path: str) -> tuple[Path, str] | None:
    """(name, text) of a job given as a stream: `-` (standard input) or a pipe (`<(envsubst < job.yaml)`,
    /dev/fd/N), read once and kept, at most MAX_JOB_FILE_BYTES of UTF-8. None for anything else (a regular
    file, a missing path: `file_layer` reads it or says why)."""
    import stat
    import sys

    from gpufleet.config.layers import MAX_JOB_FILE_BYTES
    from gpufleet.errors import UserError

    stdin = job_path == STDIN
    try:
        st = os.fstat(sys.stdin.fileno()) if stdin else os.stat(job_path)
    except (OSError, ValueError):  # no such path (file_layer says so), or no stdin at all
        if not stdin:
            return None
        st = None
    name = Path("<stdin>" if stdin else job_path)
    fix = f"pipe a job in (envsubst < job.yaml | gpufleet check {STDIN}), or name a .yaml file"
    if stdin and (st is None or sys.stdin.isatty()):
        raise UserError(
            f"job file {STDIN!r} reads the job from standard input, but nothing is piped in.", fix=fix
        )
    if not stdin and not (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
        return None
    key = (st.st_dev, st.st_ino)
    if key not in _STREAMS:
        if stdin:
            data = sys.stdin.buffer.read(MAX_JOB_FILE_BYTES + 1)
        else:
            with open(job_path, "rb") as f:
                data = f.read(MAX_JOB_FILE_BYTES + 1)
        if len(data) > MAX_JOB_FILE_BYTES:
            raise UserError(
                f"job file {str(name)!r} is over {MAX_JOB_FILE_BYTES >> 20} MiB; a job file is at most 1 MiB.",
                fix="is this the right input? a job is a few dozen lines of YAML",
            )
        if not data.strip():
            raise UserError(f"job file {str(name)!r} is empty (the pipe gave nothing).", fix=fix)
        try:
            _STREAMS[key] = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UserError(
                f"{name}:{line}: not UTF-8 text (byte {data[e.start]:#04x}).", fix="give UTF-8."
            ) from None
    return name, _STREAMS[key]


_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".gz", ".bz2", ".xz")


def _anchor_paths(resolved: Resolved, base: Path, kinds: tuple[str, ...] = ("file",)) -> None:
    """Paths the job file wrote are relative to the job file's folder, not to the working directory
    (flags and environment values stay relative to the working directory). They become absolute here,
    so every rank, every message and the run's job.yaml see the same path. A value that names no local
    file (a hub id like Qwen/Qwen2.5-0.5B) is left alone; `output.dir` follows the working directory.
    `kinds`: the layers whose paths are made absolute against `base`."""
    from gpufleet.usercode import anchored

    def local(value: str) -> str:
        if value.startswith("builtin:") or user_path(value).is_absolute():
            return value
        candidate = (base / value).resolve()
        explicit = value.startswith(("./", "../", "~")) or value.endswith(_DATA_SUFFIXES)
        return str(candidate) if candidate.exists() or explicit else value

    job = resolved.job
    for section, name in (("model", "path"), ("data", "path"), ("reward", "model"), ("env", "token_file")):
        value = getattr(getattr(job, section), name)
        if value and resolved.source(f"{section}.{name}").kind in kinds:
            setattr(getattr(job, section), name, local(value))
    if resolved.source("reward.functions").kind in kinds:
        job.reward.functions = [anchored(f, base) if ":" in f else f for f in job.reward.functions]
    if job.rollout.tools and resolved.source("rollout.tools").kind in kinds:
        job.rollout.tools = [anchored(f, base) if ":" in f else f for f in job.rollout.tools]
    name = job.env.name
    if name and resolved.source("env.name").kind in kinds and not name.startswith(("builtin:", "gymnasium:")):
        job.env.name = anchored(name, base)


def portable(resolved: Resolved, cwd: Path | None = None) -> tuple[Resolved, dict[str, str]]:
    """A copy of the job whose paths resolve from any folder (what `gpufleet config --format yaml` writes, a
    file the user may move): paths a flag or the environment gave (relative to the working directory `cwd`)
    made absolute, as the job file's already are, and a user module a reward or env names (`mymod:fn`, found
    in the job file's folder or the working directory, which are searched first) written as its file
    (`/abs/mymod.py:fn`). A module that is a package or dotted cannot be named by its file: the note
    (field -> text) says where it is. `output.dir` stays relative to the working directory (results land
    where you run). (The run's own job.yaml needs none of this: its ranks share the launcher's working
    directory and get those folders on their PYTHONPATH.)"""
    from gpufleet import usercode

    cwd = Path.cwd() if cwd is None else cwd
    out = Resolved(
        resolved.job.model_copy(deep=True), dict(resolved.sources), list(resolved.problems), resolved.job_path
    )
    _anchor_paths(out, cwd.resolve(), kinds=("env", "flag"))
    folders = [Path(f) for f in usercode.roots(resolved.job_path)]
    notes: dict[str, list[str]] = {}

    def home(ref: str, path: str) -> str:
        where, attr = usercode.split(ref)
        if not where or usercode.is_file(where) or ref.startswith(("builtin:", "gymnasium:")):
            return ref
        top = where.split(".", 1)[0]
        found = next((f for f in folders if (f / f"{top}.py").is_file() or (f / top).is_dir()), None)
        if found is None:  # installed, or on PYTHONPATH: the same from any folder
            return ref
        file = found.resolve() / f"{where}.py"
        if "." not in where and file.is_file():
            notes.setdefault(path, []).append(f"{ref} is {file}")
            return f"{file}:{attr}"
        notes.setdefault(path, []).append(f"{where} is imported from {found.resolve()}: put it on PYTHONPATH")
        return ref

    job = out.job
    job.reward.functions = [home(f, "reward.functions") for f in job.reward.functions]
    if job.env.name:
        job.env.name = home(job.env.name, "env.name")
    return out, {path: "; ".join(said) for path, said in notes.items()}


def _validate_section(name, cls, candidates, problems):
    """Validate with the highest candidate of each field; a rejected value falls back a layer."""
    while True:
        values = {f: c[0][0] for f, c in candidates.items() if c}
        try:
            return cls(**values), {f: c[0][1] for f, c in candidates.items() if c}
        except ValidationError as err:
            bad: dict[str, list[dict]] = {}
            for e in err.errors():
                if e["loc"] and isinstance(e["loc"][0], str) and e["loc"][0] in candidates:
                    bad.setdefault(e["loc"][0], []).append(e)
            if not bad:  # pragma: no cover - every field error has a location
                raise
            for fld, e in bad.items():
                value, src = candidates[fld].pop(0)
                trl = _trl_value(f"{name}.{fld}", value, src, cls, values)
                problems.append(trl or _value_problem(f"{name}.{fld}", cls.model_fields[fld], value, src, e))


def _trl_value(path: str, value: Any, src: Source, cls, values: dict[str, Any]) -> Problem | None:
    """A refused value that is TRL's for its option of the same name: what TRL means, and gpufleet's value for
    it (gpufleet.config.trl.value)."""
    from gpufleet.config.trl_values import value as trl_value

    defaults = {f: info.get_default(call_default_factory=True) for f, info in cls.model_fields.items()}
    found = trl_value(path, value, {**defaults, **values})
    if found is None:
        return None
    mine, why = found
    return Problem(
        "error",
        [FieldRef(path, value, src)],
        why + ".",
        _how(path, mine, src),
    )


def _value_problem(path: str, info, value: Any, src: Source, errors: list[dict]) -> Problem:
    """A rejected value: say what the field accepts, with the nearest choice when it is a typo."""
    said = (str(e.get("msg", "invalid value")).rstrip(".") for e in errors)
    msg = " or ".join(dict.fromkeys(m.replace("Value error, ", "not ", 1) for m in said))
    annotation = str(info.annotation)
    choices = _literal_choices(info.annotation)
    # What the non-choice part of the type accepts ("a whole number", "a value greater than 0", ...).
    typed = [_expected(annotation, str(e.get("msg", ""))) for e in errors if e.get("type") != "literal_error"]
    accepts = ([f"one of {', '.join(choices)}"] if choices else []) + list(dict.fromkeys(typed))
    fix = ""
    if choices and isinstance(value, str):
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        if close:
            fix = f"did you mean {close[0]!r}? {_how(path, close[0], src)}"
    if not fix:
        default = info.get_default(call_default_factory=True)
        allowed = " or ".join(accepts) or "a valid value"
        if default is None:
            fix = f"use {allowed}, or remove it to leave it unset (the default)"
        else:
            fix = f"use {allowed}, e.g. the default: {_how(path, default, src)}"
    return Problem("error", [FieldRef(path, value, src)], msg + ".", fix)


def _expected(annotation: str, msg: str) -> str:
    if msg.startswith("Value error, "):  # a validator of ours: its message says what the field takes
        return msg.removeprefix("Value error, ").rstrip(".")
    if "greater than" in msg or "less than" in msg:
        return "a value " + msg.split("Input should be ", 1)[-1].rstrip(".")
    if "list" in annotation:
        return "a list such as 0,1,2"
    if "dict" in annotation:
        return "a mapping such as {name: value}"
    if "int" in annotation:
        return "a whole number"
    if "float" in annotation:
        return "a number"
    if "bool" in annotation:
        return "true or false"
    return "a string"


def _how(path: str, value: Any, src: Source) -> str:
    text = format_value(value).replace(" ", "")
    if src.kind == "env":
        return f"{src.detail}={text}"
    if src.kind == "file":
        return f"write `{path.split('.', 1)[1]}: {format_value(value)}` at {src.detail}"
    return f"--set {path}={text}"


def field_choices(path: str) -> tuple[list[str], str, bool]:
    """A field's named choices (its Literal words), what else it takes besides them ('' when nothing: "a
    whole number", "a list such as 0,1,2") and whether null is allowed."""
    from typing import Literal, get_args, get_origin

    section, name = path.split(".", 1)
    annotation = SECTIONS[section].model_fields[name].annotation
    words = _literal_choices(annotation)
    args = get_args(annotation) if get_origin(annotation) is not Literal else ()
    rest = [a for a in args if a is not type(None) and get_origin(a) is not Literal]
    nullable = type(None) in args
    return words, _expected(str(annotation), "") if words and rest else "", nullable


def _literal_choices(annotation) -> list[str]:
    """String choices of a Literal field, also inside `Literal[...] | X` and Annotated."""
    from typing import Literal, get_args, get_origin

    found: list[str] = []

    def walk(tp):
        if get_origin(tp) is Literal:
            found.extend(a for a in get_args(tp) if isinstance(a, str))
        else:
            for arg in get_args(tp):
                walk(arg)

    walk(annotation)
    return found


# ----------------------------------------------------------------------------------------- layers


def _apply_presets(resolved: Resolved) -> None:
    algo = resolved.job.algorithm
    for name, value in PRESETS[algo.name].items():
        if getattr(algo, name) is None:
            setattr(algo, name, value)
            resolved.sources[f"algorithm.{name}"] = Source("preset", algo.name)
    train = resolved.job.train
    if train.micro_batch is None:
        train.micro_batch = train.per_device_batch
        resolved.sources["train.micro_batch"] = Source("derived", "= train.per_device_batch")


def dump_job(resolved: Resolved) -> dict[str, dict[str, Any]]:
    """The resolved job as plain data (a valid job file when written as YAML)."""
    return resolved.job.model_dump(mode="json")
