"""Where a step's time goes: a per-process clock of exclusive phases, and the step's timing metrics.

    clock.start_step()
    with clock.phase("generate"):          # sampling
        with clock.phase("score"): ...     # rewards, reference: paused generate meanwhile
        with clock.phase("comm"): ...      # a collective (dist.py's helpers time themselves)
    seconds = clock.end_step()             # {"generate": .., "score": .., "comm": .., "other": ..}

Phases nest and are exclusive: the inner one pauses the outer one, so the seconds of every phase plus
`other` (time under no phase) add up to the step's wall time exactly. The cost is two
`time.perf_counter()` calls per phase entered (about a microsecond); no device synchronisation is
added, so on a GPU a phase ends when its Python code returns (the next blocking call pays for queued
kernels; collectives and `.item()` block, so the bulk lands where it belongs).

`step_timings` turns every policy rank's seconds into the metrics of the step: `timing/<phase>`
(rank 0's: with `timing/other` they add up to `step_time`), `timing/<phase>/max` (the slowest rank)
and `timing/<phase>/rank<r>` (each rank, only with more than one); `step_time/max` and
`step_time/rank<r>` the same for the step's wall time. Ranks meet in collectives, so their step
times differ by when each one enters the step: a rank that waits on another shows it as `comm`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

PHASES = ("generate", "score", "env", "tools", "backward", "optimizer", "comm", "checkpoint", "other")
"""Every phase a step is split into, in the order the report stacks them."""


class PhaseClock:
    """Exclusive phase timer of one process (see the module docstring)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._stack: list[str] = []
        self._since = time.perf_counter()
        self._step_start = self._since

    def _switch(self) -> None:
        """Charge the time since the last switch to the phase that was running."""
        now = time.perf_counter()
        self.seconds[self._stack[-1] if self._stack else "other"] += now - self._since
        self._since = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        self._switch()
        self._stack.append(name)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def start_step(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._stack.clear()
        self._since = self._step_start = time.perf_counter()

    def end_step(self) -> dict[str, float]:
        """Seconds per phase since `start_step` (their sum is the step's wall time)."""
        self._switch()
        return dict(self.seconds)


def step_timings(per_rank: Sequence[Sequence[float]], walls: Sequence[float]) -> dict[str, float]:
    """The timing metrics of one step from each policy rank's seconds per phase (in `PHASES` order;
    rank 0 first) and each rank's wall time of the step (measured apart from the clock)."""
    if not per_rank:
        return {}
    m: dict[str, float] = {}
    many = len(per_rank) > 1
    for i, name in enumerate(PHASES):
        values = [float(r[i]) for r in per_rank]
        m[f"timing/{name}"] = values[0]
        m[f"timing/{name}/max"] = max(values)
        if many:
            for r, v in enumerate(values):
                m[f"timing/{name}/rank{r}"] = v
    m["step_time/max"] = max(walls)
    if many:
        for r, wall in enumerate(walls):
            m[f"step_time/rank{r}"] = float(wall)
    return m
