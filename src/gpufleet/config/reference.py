"""The job-file reference of the user guide (docs/reference.md), generated from the schema: every field's
name, type, default, environment variable and docstring.

python -m gpufleet.config.reference > docs/reference.md   # tests/test_docs.py fails when it is stale
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args, get_origin

from gpufleet.config.problems import format_value
from gpufleet.config.schema import SECTIONS, field_doc

HEADER = """\
# Job file reference

<!-- Generated from src/gpufleet/config/schema.py by `python -m gpufleet.config.reference > docs/reference.md`;
     do not edit by hand (tests/test_docs.py fails when this file is stale). -->

Every field of a job file, section by section: its type, its default, the environment variable that sets
it, and its documentation (the docstring in `src/gpufleet/config/schema.py`, also shown by
`gpufleet config --explain FIELD`). Every field is optional. Any field can also be set with
`--set section.field=value`; how the layers combine is in [The job file](job-file.md).
"""

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_NAMED = {"_split_command": "command line (a string or a list)", "_size": "size (`20GB`; GB = GiB)"}


def type_text(annotation: Any, metadata: list | tuple = (), words: str = "one of ") -> str:
    """A field's type in words: `int >= 1`, one of `ddp`, `fsdp`, `list of int`, `str or null`."""
    named = [_NAMED[f.__name__] for m in metadata if (f := getattr(m, "func", None)) and f.__name__ in _NAMED]
    if named:
        return named[0]
    bounds = [
        f"{op} {format_value(getattr(m, k))}" for m in metadata for k, op in _BOUNDS.items() if hasattr(m, k)
    ]
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        inner = [x for m in extra for x in getattr(m, "metadata", [m])]
        return type_text(base, [*metadata, *inner], words)
    if origin is Literal:
        return words + ", ".join(f"`{a}`" for a in get_args(annotation))
    if origin is Union or type(annotation).__name__ == "UnionType":
        parts = [a for a in get_args(annotation) if a is not type(None)]
        text = " or ".join(
            type_text(a, metadata if i == len(parts) - 1 else (), "") for i, a in enumerate(parts)
        )
        if len(parts) == 1 and get_origin(parts[0]) is Literal:
            text = words + text
        return text + (" or null" if type(None) in get_args(annotation) else "")
    if origin is list:
        return "list of " + type_text(get_args(annotation)[0])
    if origin is dict:
        return "mapping"
    name = getattr(annotation, "__name__", str(annotation))
    return " ".join([name, ", ".join(bounds)]).strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    out = [HEADER]
    for section, cls in SECTIONS.items():
        out.append(f"## `{section}`\n")
        out.append("| field | type | default | meaning |")
        out.append("|---|---|---|---|")
        for name, info in cls.model_fields.items():
            default = format_value(info.get_default(call_default_factory=True))
            env = f"GPUFLEET_{section.upper()}__{name.upper()}"
            kind = type_text(info.annotation, info.metadata)
            doc = field_doc(f"{section}.{name}")
            out.append(
                f"| `{section}.{name}`<br>`{env}` | {_cell(kind)} | `{_cell(default)}` | {_cell(doc)} |"
            )
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
