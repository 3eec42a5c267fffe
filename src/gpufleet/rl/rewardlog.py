"""TRL 1.16's `trainer_state`, `log_metric` and `log_extra` for reward functions.

TRL passes every reward function `trainer_state` (its `transformers.TrainerState`: `global_step`,
`max_steps`, ...), `log_metric(name, value)` (the values of a step averaged into metric `name`) and
`log_extra(column, values)` (per-completion columns of its completions table). gpufleet passes them to a
function that takes them (`usercode.call_reward`): a `TrainerState` with the optimizer steps done when
the batch was generated, the step's metric (averaged over the values every policy rank logged) in
metrics.jsonl and the console's metrics, and the columns beside each completion in samples.jsonl
(`extra`). A curriculum reward written for TRL (`trainer_state.global_step`) runs unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpufleet.dist import Runtime, all_gather_objects
from gpufleet.usercode import LOGGING

__all__ = ["RewardLog"]


class RewardLog:
    """The logging keywords of one generation step's reward calls, and what the functions logged."""

    def __init__(self, global_step: int, max_steps: int):
        self.global_step, self.max_steps = global_step, max_steps
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list[Any]] = {}

    @functools.cached_property
    def state(self):
        """TRL's `trainer_state`, made when a reward function takes it (importing it costs 0.3 s)."""
        from transformers import TrainerState

        return TrainerState(global_step=self.global_step, max_steps=self.max_steps)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: one value of metric `name` for this step."""
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's `log_extra`: values of `column`, one per completion (in the order of the call)."""
        self.extras.setdefault(str(column), []).extend(values)

    def keywords(self) -> Mapping[str, Any]:
        """The keywords by name; `trainer_state` is made when looked up."""
        return _Keywords(self)

    def step_metrics(self, rt: Runtime) -> dict[str, float]:
        """Each logged metric's mean over every value the policy ranks logged this step (every rank takes
        part: each calls this once a step)."""
        totals: dict[str, list[float]] = {}
        for logged in all_gather_objects(rt, {k: (sum(v), len(v)) for k, v in self.metrics.items()}):
            for name, (total, count) in logged.items():
                acc = totals.setdefault(name, [0.0, 0])
                acc[0] += total
                acc[1] += count
        return {name: total / count if count else math.nan for name, (total, count) in totals.items()}

    def row_extras(self, rows: int) -> list[dict[str, Any]]:
        """Per completion, the logged columns that have one value per completion."""
        columns = {k: v for k, v in self.extras.items() if len(v) == rows}
        return [{k: v[i] for k, v in columns.items()} for i in range(rows)]


class _Keywords(Mapping):
    """`RewardLog.keywords()`: its values, each looked up when asked for."""

    _NAMES = LOGGING

    def __init__(self, log: RewardLog):
        self.log = log

    def __getitem__(self, name: str) -> Any:
        if name not in self._NAMES:
            raise KeyError(name)
        return getattr(self.log, "state" if name == "trainer_state" else name)

    def __iter__(self):
        return iter(self._NAMES)

    def __len__(self) -> int:
        return len(self._NAMES)
