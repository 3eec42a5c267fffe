"""Environment calls on a thread of their own, so that whoever waits for them can time them (`Runner`).

An env server (server.py: its event loop waits) and LocalPool (table.py, env.servers: 0: the trainer
waits) run their environments through a Runner: one daemon thread, jobs in order, one at a time. The
table of live environments (`Episodes`) says which call runs now (`Call`: Class.method, episode, seed or
action). The waiter ticks (`Waiter.tick`) while it waits: from min(5 s, limit / 2) on it says
"gpufleet: waiting for Class.step (episode E, action '...') for N s (limit L s)", and past the call's limit
(env.reset_timeout for making an environment and its reset, env.step_timeout for a step or a close) it
gives up with `EnvTimeout`: the class, the method, the episode, the action, and where the environment is
stuck (file:line of the user's innermost frame, read from the thread's live stack).

A stuck call cannot be interrupted (a thread cannot be): the run stops on the error, the thread is a
daemon and ends with its process; a job queued behind a stuck call is cancelled by its waiter and
answered with the stuck call's EnvTimeout (the server stays stuck until the call returns, if ever).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

from gpufleet.env.base import EnvError
from gpufleet.watchdog import HEARTBEAT_EVERY, HEARTBEAT_FIRST, where_stuck

DEFAULT_TIMEOUT = 600.0
"""Seconds an environment call may take when nobody says (env.reset_timeout, env.step_timeout)."""
SETTING = {"__init__": "env.reset_timeout", "reset": "env.reset_timeout"}
"""The setting that bounds a method (every other one: env.step_timeout)."""
TICK_S = 0.1
"""How often a waiter looks at the call running now."""


@dataclass
class Call:
    """The environment call running now on a Runner's thread."""

    cls: str
    method: str  # __init__ (making the environment), reset, step, close
    episode: str
    detail: str = ""  # "seed 3", "action 'kk'"
    start: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        what = ", ".join(x for x in (f"episode {self.episode}", self.detail) if x)
        return f"{self.cls}.{self.method} ({what})"


def action_detail(action: str) -> str:
    """An action as a heartbeat or an error quotes it (the first 40 characters)."""
    return f"action {action if len(action) <= 40 else action[:37] + '...'!r}"


class EnvTimeout(EnvError):
    """An environment call did not return within its limit; `wire` is its JSON form (server -> client)."""

    def __init__(self, wire: dict, server: str = ""):
        self.wire, self.setting = dict(wire), SETTING.get(wire.get("method", ""), "env.step_timeout")
        on = f" on {server}" if server else ""
        where = f"; it is stuck at {wire['where']}" if wire.get("where") else ""
        name = "" if wire["name"].endswith(":" + wire["call"].split(".")[0]) else f"{wire['name']}: "
        super().__init__(
            f"{name}{wire['call']}{on} did not return within {self.setting} {wire['limit']:g} s{where}"
        )


class Runner:
    """One thread that runs jobs (functions calling environments) in order; see the module docstring."""

    def __init__(self, table: Any):
        self.table = table  # its `now` is the Call running (None between calls)
        self.limit = DEFAULT_TIMEOUT  # the job running now's limit per call
        self._jobs: SimpleQueue = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any], limit: float) -> Future:
        """Queue `job` (each environment call in it bounded by `limit` s); its Future."""
        future: Future = Future()
        self._jobs.put((future, job, limit))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="gpufleet-env", daemon=True)
                self._thread.start()
        return future

    def run(self, job: Callable[[], Any], limit: float, say: Callable[[str], None]) -> Any:
        """Submit `job` and wait for it here (ticking); its result, or EnvTimeout."""
        future, waiter = self.submit(job, limit), Waiter(self, say)
        while True:
            try:
                return future.result(timeout=TICK_S)
            except TimeoutError:
                waiter.tick(future)

    def busy(self) -> dict | None:
        """The call running now: {"call": description, "for": seconds}, or None."""
        call = self.table.now
        return None if call is None else {"call": call.describe(), "for": time.monotonic() - call.start}

    def stuck(self) -> bool:
        """Whether a call has been running past its limit."""
        call = self.table.now
        return call is not None and time.monotonic() - call.start > self.limit

    def overdue(self) -> EnvTimeout | None:
        """EnvTimeout for the call running now if it has passed its limit."""
        call, limit = self.table.now, self.limit
        if call is None or time.monotonic() - call.start <= limit:
            return None
        wire = {"name": self.table.name, "call": call.describe(), "method": call.method, "limit": limit}
        return EnvTimeout(wire | {"where": self._where()})

    def _where(self) -> str:
        """file:line of the user's innermost frame on this Runner's thread now."""
        frame = sys._current_frames().get(self._thread.ident) if self._thread else None
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        tb = None
        for f in frames:  # innermost first: the chain ends up outermost -> innermost, as a raise makes it
            tb = types.TracebackType(tb, f, f.f_lasti, f.f_lineno)
        probe = RuntimeError()
        probe.__traceback__ = tb
        return where_stuck(probe)

    def _work(self) -> None:
        while True:
            future, job, limit = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            self.limit = limit
            try:
                future.set_result(job())
            except BaseException as e:  # the waiter re-raises it
                future.set_exception(e)
            finally:
                self.table.now = None


class Waiter:
    """What a waiter does each tick: heartbeats about the call running now, EnvTimeout past its limit."""

    def __init__(self, runner: Runner, say: Callable[[str], None]):
        self.runner, self.say = runner, say
        self._call: Call | None = None
        self._beat = 0.0

    def tick(self, future: Future) -> None:
        stuck = self.runner.overdue()
        if stuck is not None:
            future.cancel()  # not started yet (queued behind the stuck call): it never will be
            raise stuck
        call, limit = self.runner.table.now, self.runner.limit
        if call is None:
            return
        if call is not self._call:
            self._call, self._beat = call, min(HEARTBEAT_FIRST, limit / 2)
        elapsed = time.monotonic() - call.start
        if elapsed >= self._beat:
            self.say(heartbeat(call.describe(), elapsed, limit))
            self._beat += HEARTBEAT_EVERY


def heartbeat(what: object, elapsed: float, limit: float | None = None) -> str:
    """The line a slow call gets (watchdog.py's words)."""
    return f"gpufleet: waiting for {what} for {elapsed:.0f} s" + (f" (limit {limit:g} s)" if limit else "")


class Heartbeat:
    """One thread that says what a slow wait waits for: `with beat.watching(what, first):` -- `what` is
    formatted (str()) at each beat, first after `first` s, then every HEARTBEAT_EVERY s. One thread for
    all the waits of its owner (a thread per wait costs 0.3-0.7 ms a call)."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self._cv = threading.Condition()
        self._what: object = None
        self._limit: float | None = None
        self._since = self._due = 0.0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, what: object, first: float, limit: float | None = None) -> Iterator[None]:
        with self._cv:
            self._what, self._limit, self._since = what, limit, time.monotonic()
            self._due = self._since + first
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpufleet-heartbeat", daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._what = None

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._what is None or time.monotonic() < self._due:
                    self._cv.wait(None if self._what is None else self._due - time.monotonic())
                what, elapsed, limit = self._what, time.monotonic() - self._since, self._limit
                self._due += HEARTBEAT_EVERY
            self.say(heartbeat(what, elapsed, limit))  # outside the lock: str(what) may ask a server


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
