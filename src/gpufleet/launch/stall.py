"""`gpufleet launch`'s watchdog over a script it cannot see inside. When no rank of this node has printed
anything (stdout, stderr, progress lines: every byte lands in logs/rank<R>.log) for
`launch.collective_timeout` seconds, counted from when every rank of the node has started (a wait at a
multi-node rendezvous has launch.rendezvous_timeout), every rank's Python stack is dumped (faulthandler,
see stackhook). If a rank waits inside a torch.distributed collective, the run hangs: the rank that did not
arrive is named with its file:line and the run is stopped. If none does (a silent evaluation, a download,
or NCCL, whose waits show at the next synchronisation), the run goes on, and is stopped only if, another
collective_timeout later and still silent, no rank has moved (every main thread at the same lines). While
the ranks are silent for more than a minute it says so, once a minute."""

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
        waiting: str | None = None,
    ):
        self.logs, self.ranks, self.timeout, self.hooks = logs, ranks, timeout, hooks
        self.stacks_file, self.say = stacks_file, say
        self.sizes: list[int] = []
        self.initial = self._sizes()  # logs of earlier runs in the same folder
        self.started = False
        self.deadline = timeout  # seconds of silence at which the stacks are looked at (next)
        self.before: dict | None = None  # where every rank was at the last look, if none was in a collective
        self.last = time.monotonic()
        self.first = self.beat = first
        self.found: list[str] | None = None
        self.blame: list[int] = []
        self.stacks: list[str] = []
        self.quiet = 0.0
        self.waiting = waiting or f"launch.collective_timeout {timeout:g} s"
        """What the heartbeat says it waits for."""

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
            self.deadline, self.before = self.timeout, None
            return False
        self.quiet = now - self.last
        if self.quiet >= self.deadline:
            return self._check()
        if self.quiet >= self.beat:
            self.say(f"gpufleet: no rank has printed for {self.quiet:.0f} s; waiting ({self.waiting})")
            self.beat += HEARTBEAT_EVERY
        return False

    def _check(self) -> bool:
        """Look at every rank's stack: True (stop) if one waits in a collective or none moved since the
        last look; else say where they are and look again a collective_timeout later."""
        dumped = stacks.dump(self.hooks)
        places = {r: tuple((f.file, f.line) for f in s.main) if s else None for r, s in dumped.items()}
        waiting = any(s is not None and s.collective for s in dumped.values())
        if waiting or places == self.before:
            stacks.write(dumped, self.stacks_file)
            self.found, self.blame = stacks.findings(dumped, self.ranks)
            self.stacks = [x for r in sorted(dumped) for x in stacks.brief(r, dumped[r])]
            return True
        where = "; ".join(f"rank {r} at {s.where}" for r, s in sorted(dumped.items()) if s and s.where)
        self.say(
            f"gpufleet: no rank has printed for {self.quiet:.0f} s and none waits in a torch.distributed call "
            f"({where or 'no Python stacks'}); still running: stopped if no rank has moved in another "
            f"{self.timeout:g} s (launch.collective_timeout)"
        )
        self.before, self.deadline = places, self.deadline + self.timeout
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


def heartbeat(logs: Path, ranks: list[int], collective_timeout: float) -> Silence:
    """`gpufleet train`'s voice while its ranks are silent (a long step, a hang): the same lines from
    min(60 s, collective_timeout / 2) on, once a minute; it never stops the run itself: a collective that
    waits collective_timeout fails, and that rank shows every rank's stack (launch/worker.py)."""
    waiting = f"a collective that waits launch.collective_timeout {collective_timeout:g} s fails, with every rank's stack"
    return Silence(
        logs,
        ranks,
        float("inf"),
        logs,
        logs / "stacks.txt",
        first=min(HEARTBEAT_FIRST, collective_timeout / 2),
        waiting=waiting,
    )
