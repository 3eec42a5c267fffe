"""The layers of a job, each `{section.field: (value, Source)}`: the job file (a regular file under 1 MiB,
YAML without duplicate keys or tabs, with the line of every value), Slurm (the nodes of an srun step), the
environment (`GPUFLEET_<SECTION>__<FIELD>`) and the flags (`--set section.field=value`). Unknown keys become problems
with a "did you mean"."""

from __future__ import annotations

import difflib
import stat
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpufleet.config.problems import FieldRef, Problem, Source, format_value
from gpufleet.config.schema import SECTIONS, field_paths
from gpufleet.config.trl import lookup
from gpufleet.config.trl_values import batch
from gpufleet.config.trl_values import given as trl_given
from gpufleet.errors import UserError

ENV_PREFIX = "GPUFLEET_"
_NULLS = ("null", "none", "~")
_NO_VALUE = object()


def _unknown_key(
    key: str, src: Source, section: str | None, value: Any = _NO_VALUE, given: Mapping[str, Any] | None = None
) -> Problem:
    """An unknown key: TRL's name for a gpufleet field (gpufleet.config.trl) says which; otherwise a "did
    you mean" from the same section first, then any section. `given`: the layer's TRL batch names (trl.given)."""
    shown = key if section is None else f"{section}.{key}"
    trl = _trl_problem(key, shown, section, value, src, given)
    if trl is not None:
        return trl
    mapping = _into_mapping(key, shown, section, value, src)
    if mapping is not None:
        return mapping
    paths = field_paths()
    suggestion = None
    if section is None:
        options = list(SECTIONS) + paths + [p.split(".", 1)[1] for p in paths]
        match = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
        if match:
            suggestion = match[0] if match[0] in SECTIONS or "." in match[0] else _owner(match[0])
        what = f"unknown section {key!r}"
        known = f"sections are {', '.join(SECTIONS)}"
    else:
        fields = list(SECTIONS[section].model_fields)
        scored = [(_ratio(key, f), 1, f"{section}.{f}") for f in fields]
        scored += [(_ratio(key, p.split(".", 1)[1]), 0, p) for p in paths if not p.startswith(section + ".")]
        score, _, best = max(scored)
        suggestion = best if score >= 0.6 else None
        what = f"unknown field {key!r} in section {section!r}"
        known = f"{section} has {', '.join(fields)}"
    fix = f"did you mean {suggestion}?" if suggestion else f"remove it; {known}"
    if suggestion and src.kind == "env":
        rest = (
            src.detail.split("=", 1)[0].split("__", 1)[1:]
            if section is None and suggestion in SECTIONS
            else []
        )
        fix += f" ({ENV_PREFIX}{'__'.join([suggestion.upper().replace('.', '__'), *rest])})"
    found = {"suggestion": suggestion} if suggestion else {}
    return Problem("error", [FieldRef(shown, "(unknown key)", src)], what + ".", fix, found)


def _into_mapping(key: str, shown: str, section: str | None, value: Any, src: Source) -> Problem | None:
    """`env.kwargs.mode=x`: a key inside a mapping field is set with the whole mapping, `env.kwargs={mode: x}`."""
    head, dot, rest = key.partition(".")
    if section not in SECTIONS or not dot or head not in SECTIONS[section].model_fields:
        return None
    if "dict" not in str(SECTIONS[section].model_fields[head].annotation):
        return None
    inner = f"{{{rest}: {format_value(value) if value is not _NO_VALUE else '...'}}}"
    field = f"{section}.{head}"
    how = f'--set "{field}={inner}"' if src.kind != "file" else f"write `{head}: {inner}` under `{section}:`"
    return Problem(
        "error",
        [FieldRef(shown, "(unknown key)", src)],
        f"{field} is a mapping: a key inside it is set with the whole mapping.",
        f"{how} (with its other keys, if any)",
        {"suggestion": field},
    )


def unknown_name(name: str, src: Source) -> Problem:
    """The problem of `name` (`section.field` or a bare name) when it is no job field: TRL's name for one, the
    nearest field, or the list; `extra["suggestion"]` holds the field it points at, if any."""
    section, dot, key = name.partition(".")
    if dot and section in SECTIONS:
        return _unknown_key(key, src, section)
    return _unknown_key(name, src, None)


def _trl_problem(
    key: str, shown: str, section: str | None, value: Any, src: Source, given: Mapping[str, Any] | None = None
) -> Problem | None:
    """`shown` is TRL's option `key`: gpufleet's field for it and the value to write there (TRL's batch names
    computed together with the others of the layer, `given`: trl.batch), or that gpufleet has none. In
    `script:` (a `gpufleet launch` recipe) a TRL name points at the script's own field when it has one, and
    is otherwise left to the "did you mean"."""
    option = lookup(key)
    if option is None:
        return None
    ref = [FieldRef(shown, "(unknown key)", src)]
    target = option.field
    if section == "script" and target is not None:
        mine = f"script.{target.split('.', 1)[1]}"
        if mine not in field_paths():
            return None
        target = mine
    trl_units = key == "steps_per_generation" and bool(given) and "gradient_accumulation_steps" in given
    if target is not None and target.split(".", 1)[1] == key and not trl_units:
        return None  # gpufleet's name too, only the section is wrong: the "did you mean" finds it
    if target is None:
        why = f"`{shown}` is TRL's {key}; gpufleet has no field for it: {option.note}."
        return Problem("error", ref, why, option.fix or "remove it")
    note = f" ({option.note})" if option.note and target == option.field else ""
    why = f"`{shown}` is TRL's name: gpufleet's is `{target}`{note}."
    converted = None
    if value is not _NO_VALUE and option.convert is not None:
        converted = option.convert(value)
    joint = None if value is _NO_VALUE or section == "script" else batch(key, {**(given or {}), key: value})
    if joint is not None:
        fields, note = joint
        fix = _write(fields, src) + (f" ({note})" if note else "") if fields else note
    elif converted is not None:
        fix = _write({target: converted}, src)
    elif option.fix and value is not _NO_VALUE:
        fix = option.fix.format(value=format_value(value))
    else:
        fix = f"set {target} instead"
    return Problem("error", ref, why, fix, {"suggestion": target})


def _write(values: Mapping[str, Any], src: Source) -> str:
    """How to give each `section.field` of `values` its value in the layer `src` came from."""
    texts = {path: format_value(value) for path, value in values.items()}
    if src.kind == "env":
        said = (f"{ENV_PREFIX}{p.replace('.', '__').upper()}={t.replace(' ', '')}" for p, t in texts.items())
        return " ".join(said) + " instead"
    if src.kind == "flag":
        return " ".join(f"--set {p}={t.replace(' ', '')}" for p, t in texts.items()) + " instead"
    sections = dict.fromkeys(p.split(".", 1)[0] for p in texts)
    under = [
        _listed([f"`{p.split('.', 1)[1]}: {t}`" for p, t in texts.items() if p.startswith(s + ".")])
        + f" under `{s}:`"
        for s in sections
    ]
    return "write " + _listed(under) + " instead"


def _listed(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()


def _owner(field_name: str) -> str:
    for p in field_paths():
        if p.split(".", 1)[1] == field_name:
            return p
    return field_name


def _add(layer, problems, section: Any, key: Any, value: Any, src: Source, given=None) -> None:
    section_s, key_s = str(section), str(key)
    if section_s not in SECTIONS:
        problems.append(_unknown_key(section_s, src, None))
    elif key_s not in SECTIONS[section_s].model_fields:
        problems.append(_unknown_key(key_s, src, section_s, value, given))
    else:
        layer[f"{section_s}.{key_s}"] = (value, src)


MAX_JOB_FILE_BYTES = 1 << 20
"""A job file is a few dozen lines; anything over 1 MiB is not one (and would be slow to parse)."""


def _read_job_text(path: Path) -> str:
    """The job file's text: a regular UTF-8 file of at most MAX_JOB_FILE_BYTES, else a UserError."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"job file {str(path)!r} does not exist.", fix="check the path.") from None
    except OSError as e:
        raise UserError(f"cannot read job file {str(path)!r}: {e.strerror}.", fix="check the path.") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"job file {str(path)!r} is a directory.", fix="name the .yaml file.")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(
            f"job file {str(path)!r} is not a regular file (a device).",
            fix="save the job as a .yaml file.",
        )
    if st.st_size > MAX_JOB_FILE_BYTES:
        raise UserError(
            f"job file {str(path)!r} is {st.st_size / 2**20:.1f} MiB; a job file is at most 1 MiB.",
            fix="is this the right file? a job is a few dozen lines of YAML",
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x}).", fix="save it as UTF-8."
        ) from None
    except OSError as e:
        raise UserError(
            f"cannot read job file {str(path)!r}: {e.strerror}.", fix="check its permissions."
        ) from None


def _parse_yaml(path: Path, text: str):
    """(node tree, data) of the job file; syntax errors, tabs and duplicate keys as one UserError."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _no_duplicate_keys(path, node)
        return node, yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "'\\t'" in reason or "\t" in reason:
            raise UserError(
                f"{where}: a tab in the indentation; YAML indents with spaces.",
                fix="use spaces: replace the tab with spaces",
            ) from None
        raise UserError(f"{where}: not valid YAML ({reason}).", fix="fix the YAML syntax there.") from None
    except (ValueError, TypeError, RecursionError) as e:
        raise UserError(f"{path}: not a readable YAML job ({e}).", fix="fix the YAML there.") from None


def _no_duplicate_keys(path: Path, node, depth: int = 0) -> None:
    """YAML lets a repeated key silently replace the first; in a job file that loses settings."""
    if not isinstance(node, yaml.MappingNode) or depth > 2:
        return
    seen: dict[str, int] = {}
    for knode, vnode in node.value:
        if isinstance(knode, yaml.ScalarNode):
            line = knode.start_mark.line + 1
            if knode.value in seen:
                raise UserError(
                    f"{path}:{line}: `{knode.value}:` appears twice (lines {seen[knode.value]} and {line}); "
                    "the second would silently replace the first.",
                    fix=f"merge the two `{knode.value}:` blocks into one",
                )
            seen[knode.value] = line
        _no_duplicate_keys(path, vnode, depth + 1)


def file_layer(path: Path, problems: list[Problem], text: str | None = None) -> dict[str, tuple[Any, Source]]:
    """The job file's fields; `text`: the job already read from a pipe or stdin (config/load.py), named `path`."""
    node, data = _parse_yaml(path, _read_job_text(path) if text is None else text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: a job file is a mapping of sections, found a {type(data).__name__}.",
            fix="write sections such as 'train:' at the top level (see examples/quickstart.yaml).",
        )
    lines = _line_numbers(node)
    layer: dict[str, tuple[Any, Source]] = {}
    given = trl_given([(None, str(s), b) for s, b in data.items()] + _entries(data))
    for section, body in data.items():
        where = f"{path}:{lines.get((str(section),), 1)}"
        if str(section) in SECTIONS and not isinstance(body, dict):
            if body is None:
                continue
            problems.append(
                Problem(
                    "error",
                    [FieldRef(str(section), body, Source("file", where))],
                    f"section {section!r} must be a mapping of fields, found {type(body).__name__}.",
                    f"write its fields indented under '{section}:' (e.g. {section}: {{...}}).",
                )
            )
            continue
        if str(section) not in SECTIONS:
            problems.append(_unknown_key(str(section), Source("file", where), None, body, given))
            continue
        for key, value in body.items():
            src = Source("file", f"{path}:{lines.get((str(section), str(key)), 1)}")
            _add(layer, problems, section, key, value, src, given)
    return layer


def _entries(data: dict) -> list[tuple[str, str, Any]]:
    """(section, key, value) of each field of the job file's sections."""
    return [
        (str(s), str(k), v) for s, body in data.items() if isinstance(body, dict) for k, v in body.items()
    ]


def _line_numbers(node) -> dict[tuple, int]:
    """Map (section,) and (section, field) to 1-based line numbers in the YAML file."""
    out: dict[tuple, int] = {}
    if not isinstance(node, yaml.MappingNode):
        return out
    for knode, vnode in node.value:
        key = str(knode.value) if isinstance(knode, yaml.ScalarNode) else None
        out.setdefault((key,), knode.start_mark.line + 1)
        if isinstance(vnode, yaml.MappingNode):
            for k2, _ in vnode.value:
                if isinstance(k2, yaml.ScalarNode):
                    out.setdefault((key, str(k2.value)), k2.start_mark.line + 1)
    return out


def _parse_text(value: str, section: str = "", key: str = "") -> Any:
    """A value given as text (env, flag): null words become None (but "none" stays a word where the field
    has a choice named "none", e.g. algorithm.scale_rewards); the field's type parses the rest."""
    word = value.strip().lower()
    if word == "none" and "none" in _choices(section, key):
        return "none"
    return None if word in _NULLS else value


def _choices(section: str, key: str) -> set[str]:
    """The Literal string choices of a job field (empty when it has none or does not exist)."""
    model = SECTIONS.get(section)
    field = model.model_fields.get(key) if model is not None else None
    found: set[str] = set()
    stack = [field.annotation] if field is not None else []
    while stack:
        tp = stack.pop()
        if typing.get_origin(tp) is typing.Literal:
            found |= {a for a in typing.get_args(tp) if isinstance(a, str)}
        else:
            stack.extend(typing.get_args(tp))
    return found


def env_layer(env: Mapping[str, str], problems: list[Problem]) -> dict[str, tuple[Any, Source]]:
    layer: dict[str, tuple[Any, Source]] = {}
    # GPUFLEET_CACHE and friends are settings, not job fields
    names = [n for n in sorted(env) if n.startswith(ENV_PREFIX) and "__" in n]
    entries = [(*n[len(ENV_PREFIX) :].lower().partition("__")[::2], env[n]) for n in names]
    given = trl_given(entries)
    for name, (section, key, value) in zip(names, entries, strict=True):
        _add(layer, problems, section, key, _parse_text(value, section, key), Source("env", name), given)
    return layer


def slurm_layer(env: Mapping[str, str], problems: list[Problem]) -> dict[str, tuple[Any, Source]]:
    """Inside a multi-node `srun` step: launch.nnodes, node_rank and rdzv_endpoint from Slurm's variables
    (see gpufleet.slurm); what is wrong with the allocation becomes a problem naming the Slurm variable."""
    from gpufleet.slurm import derive

    found = derive(env)
    for f in found.findings:
        name, _, value = f.variable.partition("=")
        ref = FieldRef(name, value, Source("slurm"))
        problems.append(Problem(f.severity, [ref], f.why, f.fix))  # type: ignore[arg-type]
    return {path: (value, Source("slurm", why)) for path, (value, why) in found.values.items()}


def flag_layer(sets: Sequence[str], problems: list[Problem]) -> dict[str, tuple[Any, Source]]:
    layer: dict[str, tuple[Any, Source]] = {}
    given = trl_given(_set_entries(sets))
    for item in sets:
        path, eq, value = item.partition("=")
        section, dot, key = path.strip().partition(".")
        src = Source("flag", f"--set {item}")
        if eq and not dot and section:
            trl = _trl_problem(section.strip(), section.strip(), None, _parse_text(value), src, given)
            if trl is not None:  # `--set bf16=true`: TRL's name, without a section
                problems.append(trl)
                continue
        if not eq or not dot or not section or not key:
            problems.append(
                Problem(
                    "error",
                    [FieldRef(path.strip() or item, item, src)],
                    f"--set takes section.field=value, got {item!r}.",
                    f"--set {_owner(section.strip())}={value.strip()}"
                    if eq and not dot and _owner(section.strip()) != section.strip()
                    else "write it like --set train.per_device_batch=4",
                )
            )
            continue
        _add(layer, problems, section, key.strip(), _parse_text(value, section, key.strip()), src, given)
    return layer


def _set_entries(sets: Sequence[str]) -> list[tuple[str | None, str, str]]:
    """(section or None, key, value) of each `--set section.field=value` / `--set name=value`."""
    out: list[tuple[str | None, str, str]] = []
    for item in sets:
        path, _, value = item.partition("=")
        section, dot, key = path.strip().partition(".")
        out.append((section.strip(), key.strip(), value) if dot else (None, section.strip(), value))
    return out
