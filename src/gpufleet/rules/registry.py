"""The rule registry: every rule a job must satisfy, checked before anything loads.

Each rule is a small function `rule(ctx) -> iterable of Problem`, registered with `@rule` (the modules
of this package register theirs when `gpufleet.rules` is imported). A rule names every field it looked
at (with value and source), says why the combination is wrong, and computes a fix from the numbers.
No torch import here: model facts come from config.json.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpufleet.config.load import Resolved
from gpufleet.config.problems import FieldRef, Problem
from gpufleet.hardware import Hardware
from gpufleet.models.info import ModelInfo
from gpufleet.topology import Topology, resolve_topology


@dataclass
class Context:
    r: Resolved
    hw: Hardware
    topo: Topology
    model: ModelInfo | None
    env: Mapping[str, str]
    notes: list[str] = field(default_factory=list)  # lines `gpufleet check` prints under its header

    @property
    def job(self):
        return self.r.job

    def ref(self, path: str) -> FieldRef:
        return self.r.ref(path)


RULES: list[Callable[[Context], Iterable[Problem]]] = []


def rule(fn: Callable[[Context], Iterable[Problem]]):
    RULES.append(fn)
    return fn


def run_checks(
    r: Resolved, hw: Hardware, env: Mapping[str, str] | None = None
) -> tuple[list[Problem], Context]:
    """All problems of a resolved job on this hardware: value problems first, then every rule."""
    env = os.environ if env is None else env
    from gpufleet.models.info import from_config
    from gpufleet.models.known import lookup_config

    topo, topo_problems = resolve_topology(r, hw)
    found = lookup_config(r.job.model.path, env)  # local config.json, else the table of known hub models
    ctx = Context(r, hw, topo, from_config(*found) if found else None, env)
    problems = list(r.problems) + topo_problems
    for fn in RULES:
        problems.extend(fn(ctx))
    return problems, ctx


def err(refs, why, fix) -> Problem:
    return Problem("error", refs, why, fix)


def warn(refs, why, fix="") -> Problem:
    return Problem("warning", refs, why, fix)
