"""A `Problem`: what `gpufleet check` reports. Fields with values and sources, why, and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Source:
    """Where a value came from: the layer and the exact place in it."""

    kind: Literal["default", "file", "slurm", "env", "flag", "preset", "derived"]
    detail: str = ""

    def __str__(self) -> str:
        if self.kind == "default":
            return "default"
        if self.kind == "file":
            return self.detail or "file"
        return f"{self.kind} {self.detail}".strip()


DEFAULT = Source("default")


@dataclass(frozen=True)
class FieldRef:
    """A field as shown in a problem: its name, the value it has (or was given), and its source."""

    path: str
    value: Any
    source: Source

    def __str__(self) -> str:
        return f"{self.path} = {format_value(self.value)} ({self.source})"


@dataclass
class Problem:
    severity: Literal["error", "warning"]
    refs: list[FieldRef]
    why: str
    fix: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def field(self) -> str:
        return self.refs[0].path if self.refs else "job"

    def render(self) -> str:
        head = "error" if self.severity == "error" else "warning"
        lines = [f"{head}: {self.field}: " + "; ".join(str(r) for r in self.refs)]
        lines.append(f"    why: {self.why}")
        if self.fix:
            lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)


def format_value(value: Any, depth: int = 0) -> str:
    """A short, bounded rendering of a value as YAML-ish text (safe on huge or nested input)."""
    if isinstance(value, str):
        text = value if value and value.strip() == value and "\n" not in value else repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    if isinstance(value, (list, tuple, dict)):
        if depth >= 2:
            return "[...]" if not isinstance(value, dict) else "{...}"
        if isinstance(value, dict):
            items = [
                f"{format_value(k, depth + 1)}: {format_value(v, depth + 1)}"
                for k, v in list(value.items())[:6]
            ]
            more = ", ..." if len(value) > 6 else ""
            return "{" + ", ".join(items) + more + "}"
        items = [format_value(v, depth + 1) for v in list(value[:8])]
        return "[" + ", ".join(items) + (", ..." if len(value) > 8 else "") + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_problems(problems: list[Problem]) -> str:
    order = sorted(problems, key=lambda p: p.severity != "error")
    return "\n".join(p.render() for p in order)


def summary(problems: list[Problem]) -> str:
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    if not problems:
        return "ok: no problems found."
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}."
