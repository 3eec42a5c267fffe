"""A deadline around a call into the user's code (a reward function, the import of a reward module).

The call runs where it always ran, in this process's main thread (user code may rely on that: signal
based timeouts such as math-verify's only work there). A watchdog thread prints a heartbeat while the
call is slow ("waiting for reward function X for 12 s") and, when the deadline passes, interrupts the
main thread with a signal whose handler raises `Overdue` inside the user's code, wherever it is (a
sleep, a loop, a blocking read). `Overdue` is a BaseException, so a user's `except Exception` does not
swallow it; its traceback shows where the user's code was when time ran out (`where_stuck`). Works on
every rank: each process watches its own calls. A call stuck inside C code that never returns to
Python cannot be interrupted this way. No torch import here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HEARTBEAT_FIRST = 5.0
"""Seconds before the first "waiting for ..." line."""
HEARTBEAT_EVERY = 30.0
"""Seconds between later "waiting for ..." lines."""
RESEND = 5.0
"""Seconds between interrupts while the user's code keeps running after the first one."""

_SIGNAL = signal.SIGUSR2


class Overdue(BaseException):
    """Raised inside the user's code in the main thread when its deadline has passed."""


@dataclass
class _Watch:
    what: str
    seconds: float | None
    first: float
    every: float
    say: Callable[[str], None]
    done: threading.Event = field(default_factory=threading.Event)
    armed: bool = False
    fired: bool = False
    start: float = field(default_factory=time.monotonic)

    def run(self, main_ident: int | None) -> None:
        beat, resend = self.first, None
        while not self.done.wait(0.05):
            elapsed = time.monotonic() - self.start
            if elapsed >= beat:
                limit = f" (limit {self.seconds:g} s)" if self.seconds else ""
                self.say(f"gpufleet: waiting for {self.what} for {elapsed:.0f} s{limit}")
                beat += self.every
            due = self.seconds is not None and elapsed >= self.seconds
            if due and main_ident is not None and (resend is None or elapsed >= resend):
                self.fired = True
                resend = elapsed + RESEND
                signal.pthread_kill(main_ident, _SIGNAL)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def deadline(
    what: str,
    seconds: float | None,
    *,
    first: float = HEARTBEAT_FIRST,
    every: float = HEARTBEAT_EVERY,
    say: Callable[[str], None] = _stderr,
) -> Iterator[_Watch]:
    """Run the body with heartbeats about `what` and, when `seconds` is not None, raise `Overdue` in it
    after that many seconds (main thread only; elsewhere there are heartbeats but no interrupt)."""
    watch = _Watch(what, seconds, first, every, say)
    on_main = threading.current_thread() is threading.main_thread()
    previous = None
    if on_main and seconds is not None:

        def handler(signum, frame):
            if watch.armed and watch.fired:
                raise Overdue(what)
            if callable(previous):
                previous(signum, frame)

        previous = signal.signal(_SIGNAL, handler)
    thread = threading.Thread(
        target=watch.run,
        args=(threading.main_thread().ident if on_main and seconds is not None else None,),
        name="gpufleet-watchdog",
        daemon=True,
    )
    watch.armed = True
    thread.start()
    try:
        yield watch
    finally:
        watch.armed = False
        watch.done.set()
        thread.join()
        if previous is not None:
            signal.signal(_SIGNAL, previous)


_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
_INSTALLED = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})


def where_stuck(e: BaseException) -> str:
    """`file:line` of the innermost frame of the user's code in `e`'s traceback, preferring files
    outside the Python installation (the user's own) to library frames ('' when there is none)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(("<", _PACKAGE))]
    own = [f for f in frames if not f.filename.startswith(_INSTALLED)] or frames
    return f"{own[-1].filename}:{own[-1].lineno}" if own else ""


def innermost_locals(e: BaseException) -> Iterator[dict]:
    """The local variables of every frame in `e`'s traceback, innermost first."""
    tb, frames = e.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_locals)
        tb = tb.tb_next
    return reversed(frames)
