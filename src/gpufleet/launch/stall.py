"""`gpufleet launch`'s watchdog over a script it cannot see inside: a run in which no rank of this node has
printed anything (stdout, stderr, progress lines: every byte lands in logs/rank<R>.log) for
`launch.collective_timeout` seconds, counted from when every rank of the node has started (a wait at a
multi-node rendezvous has launch.rendezvous_timeout), is taken to hang. Then every rank's Python stack is dumped (faulthandler,
see stackhook), the rank that did not arrive at the collective the others wait in is named with its
file:line, and the run is stopped. While the ranks are silent for more than a minute it says so, once a
minute."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpufleet.launch import stacks

HEARTBEAT_FIRST = 60.0
"""Seconds of silence before the first "no rank has printed for ..." line."""
HEARTBEAT_EVERY = 60.0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Silence:
    """`run_agent`'s `stop_when`: True once the ranks have been silent for `timeout` seconds (the stacks are
    then in `found`, `blame` and the stacks file)."""

    def __init__(
        self,
        logs: Path,
        ranks: list[int],
        timeout: float,
        hooks: Path,
        stacks_file: Path,
        say: Callable[[str], None] = _stderr,
        first: float = HEARTBEAT_FIRST,
    ):
        self.logs, self.ranks, self.timeout, self.hooks = logs, ranks, timeout, hooks
        self.stacks_file, self.say = stacks_file, say
        self.sizes: list[int] = []
        self.initial = self._sizes()  # logs of earlier runs in the same folder
        self.started = False
        self.last = time.monotonic()
        self.first = self.beat = first
        self.found: list[str] | None = None
        self.blame: list[int] = []
        self.stacks: list[str] = []
        self.quiet = 0.0

    def _sizes(self) -> list[int]:
        out = []
        for r in self.ranks:
            try:
                out.append((self.logs / f"rank{r}.log").stat().st_size)
            except OSError:
                out.append(-1)
        return out

    def __call__(self) -> bool:
        now, sizes = time.monotonic(), self._sizes()
        if not self.started:  # the clock starts once every rank here has begun its log
            self.started = all(s > i for s, i in zip(sizes, self.initial, strict=True))
        if sizes != self.sizes or not self.started:
            self.sizes, self.last, self.beat, self.quiet = sizes, now, self.first, 0.0
            return False
        self.quiet = now - self.last
        if self.quiet >= self.timeout:
            dumped = stacks.dump(self.hooks)
            stacks.write(dumped, self.stacks_file)
            self.found, self.blame = stacks.findings(dumped, self.ranks)
            self.stacks = [x for r in sorted(dumped) for x in stacks.brief(r, dumped[r])]
            return True
        if self.quiet >= self.beat:
            self.say(
                f"gpufleet: no rank has printed for {self.quiet:.0f} s; waiting "
                f"(launch.collective_timeout {self.timeout:g} s)"
            )
            self.beat += HEARTBEAT_EVERY
        return False

    def summary(self, logs: Path) -> str:
        """The paragraph printed after the run was stopped."""
        who = ", ".join(f"rank {r}" for r in self.blame) or "no rank"
        lines = [
            f"gpufleet: the run hangs: no rank printed anything for {self.quiet:.0f} s "
            f"(launch.collective_timeout {self.timeout:g} s); {who} held it up."
        ]
        lines += [f"  {x}" for x in self.found or []]
        lines += [f"  {x}" for x in self.stacks]
        lines.append(f"  every thread of every rank: {self.stacks_file}")
        lines.append(
            "  every rank was stopped. Fix: see what the rank named does at that line; if the script "
            "legitimately prints nothing for longer (a long evaluation, a download), raise "
            "--set launch.collective_timeout=<seconds>"
        )
        lines.append(f"  all logs: {logs}/")
        return "\n".join(lines)
