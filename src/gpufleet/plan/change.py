"""A change to one job field: what the planner chooses, what a fix proposes, what `train` applies.

    Change("placement.reference", [3]).flag()   # "--set placement.reference=3", for display only
    apply(r, [Change("train.micro_batch", 2)])  # the job with it, as if given with --set

Changes stay structured from the planner to the place that uses them; the only place one becomes a
`--set` string is where it is printed for the user (`flag`, `flags`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.config.load import Resolved
from gpufleet.config.problems import Source


@dataclass(frozen=True)
class Change:
    """`field` (`section.name`) set to `value`; a list value is kept as a tuple (hashable)."""

    field: str
    value: Any

    def __post_init__(self) -> None:
        if isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))

    def text(self) -> str:
        """The value as the CLI reads it back (`true`, `0,1`, `fsdp`)."""
        v = self.value
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, tuple):
            return ",".join(str(x) for x in v)
        return str(v)

    def flag(self) -> str:
        """`--set field=value`, for the user to read or paste."""
        return f"--set {self.field}={self.text()}"


Changes = tuple[Change, ...]


def changes(fields: Mapping[str, Any]) -> Changes:
    """`{"train.micro_batch": 2, ...}` -> the changes, in that order."""
    return tuple(Change(k, v) for k, v in fields.items())


def merge(*groups: Iterable[Change]) -> Changes:
    """The changes of every group; a later group's change of a field replaces an earlier one's."""
    out: dict[str, Change] = {}
    for group in groups:
        for c in group:
            out[c.field] = c
    return tuple(out.values())


def value_of(cs: Iterable[Change], field: str, default: Any) -> Any:
    """The value `cs` gives `field`, or `default`."""
    return next((c.value for c in cs if c.field == field), default)


def flags(cs: Iterable[Change]) -> str:
    """`--set a=1 --set b=2`: the changes as the user would type them."""
    return " ".join(c.flag() for c in cs)


def apply(r: Resolved, cs: Iterable[Change]) -> Resolved:
    """A copy of `r` with the changes applied as if given with --set (a derived micro_batch follows
    a changed per_device_batch, as `load_job` does). The one place a change reaches a job."""
    cs = tuple(cs)
    job = r.job.model_copy(deep=True)
    sources = dict(r.sources)
    for c in cs:
        section, name = c.field.split(".", 1)
        setattr(getattr(job, section), name, list(c.value) if isinstance(c.value, tuple) else c.value)
        sources[c.field] = Source("flag", c.flag())
    fields = {c.field for c in cs}
    if (
        "train.per_device_batch" in fields
        and "train.micro_batch" not in fields
        and r.source("train.micro_batch").kind == "derived"
    ):
        job.train.micro_batch = job.train.per_device_batch
    return Resolved(job=job, sources=sources, problems=list(r.problems), job_path=r.job_path)
