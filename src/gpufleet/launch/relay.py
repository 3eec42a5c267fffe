"""The ranks' stderr on the launcher's terminal. torchrun's agent writes its own chatter to
logs/torchrun.log, and its workers inherit that; so each rank (rankexec) writes its stderr lines into a
FIFO that the launcher reads and copies to its own stderr. Lines up to 4 KiB arrive whole (POSIX makes
such pipe writes atomic), so ranks never interleave inside a line."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


class Relay:
    def __init__(self, fifo: Path):
        self.fifo = fifo
        self.muted = threading.Event()

    def mute(self) -> None:
        """From now on the ranks' stderr goes to their logs only (gpufleet is stopping them: their dying
        words, a KeyboardInterrupt traceback per rank, would bury the one line that says what happened)."""
        self.muted.set()


@contextlib.contextmanager
def relay(fifo: Path, sink=None) -> Iterator[Relay]:
    """Make the FIFO, copy what arrives in it to `sink` (this process's stderr) until the block ends, then
    what is left."""
    sink = sink or sys.stderr.buffer
    os.mkfifo(fifo, 0o600)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # read-write: no EOF while no rank has it open
    stop = threading.Event()
    it = Relay(fifo)

    def copy() -> None:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.2)
            data = _read(fd) if ready else b""
            if data and not it.muted.is_set():
                sink.write(data)
                sink.flush()
            elif not data and stop.is_set():
                return

    thread = threading.Thread(target=copy, name="gpufleet-relay", daemon=True)
    thread.start()
    try:
        yield it
    finally:
        stop.set()
        thread.join(timeout=5)
        os.close(fd)
        fifo.unlink(missing_ok=True)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""
