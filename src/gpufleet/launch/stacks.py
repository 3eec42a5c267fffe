"""Where every rank is when a run stops making progress: signal the processes that loaded the stack hook
(`stackhook`), read what faulthandler wrote, and say which rank did not arrive at the collective the others
wait in, with file:line. Used by `gpufleet launch` (the launcher's silence watchdog) and by a `gpufleet
train` rank whose collective timed out. No torch import."""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.launch.stackhook import FOLDER_VAR, SIGNAL

_FILE = re.compile(r"^rank(\d+)\.(\d+)\.txt$")
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')
_LIBRARY = ("/site-packages/", "/dist-packages/", "<frozen", "<string>")
_COLLECTIVE = ("/torch/distributed/", "/torch/nn/parallel/distributed.py")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        code = linecache.getline(self.file, self.line).strip()
        return f"{self.file}:{self.line} in {self.func}" + (f": {code}" if code else "")


@dataclass
class RankStack:
    rank: int
    pid: int
    text: str  # what faulthandler wrote (every thread)
    main: list[Frame] = field(default_factory=list)  # the main thread, most recent call first

    @property
    def collective(self) -> str | None:
        """The torch.distributed call the main thread waits in (None when it is not in one)."""
        names = [f.func for f in self.main if any(c in f.file for c in _COLLECTIVE)]
        named = [n for n in names if n not in ("wrapper", "forward") and not n.startswith("_")]
        return (named or names or [None])[-1]

    @property
    def where(self) -> Frame | None:
        """The innermost frame of the script's own code (not a library's, not the standard library's)."""
        own = [f for f in self.main if not _library(f.file)]
        return (own or self.main or [None])[0]


def _library(file: str) -> bool:
    return any(s in file for s in _LIBRARY) or bool(re.search(r"/lib/python3\.\d+/", file))


def main_thread(text: str) -> list[Frame]:
    """The frames of the main thread in a faulthandler dump: its last block (threads are listed newest
    first, and the main thread is the oldest)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    frames = [_FRAME.match(x) for x in blocks[-1].splitlines()] if blocks else []
    return [Frame(m.group(1), int(m.group(2)), m.group(3)) for m in frames if m]


def registered(folder: Path) -> dict[int, list[int]]:
    """rank -> the pids that loaded the hook into `folder` (oldest first: the rank's own process, then
    processes it started)."""
    out: dict[int, list[tuple[float, int]]] = {}
    for f in folder.glob("rank*.txt"):
        m = _FILE.match(f.name)
        if m:
            with contextlib.suppress(OSError):
                out.setdefault(int(m.group(1)), []).append((f.stat().st_ctime, int(m.group(2))))
    return {r: [p for _, p in sorted(v)] for r, v in sorted(out.items())}


def _ours(pid: int, folder: Path) -> bool:
    """The pid is alive and is a process of this launch (its environment names this folder): a pid that
    the system reused for another program is never signalled."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{FOLDER_VAR}={folder}".encode() in env


def dump(
    folder: Path, wait_s: float = 3.0, ours: Callable[[int], bool] | None = None
) -> dict[int, RankStack | None]:
    """Every registered rank's main process's stack now (None for a rank whose process has ended).
    `ours(pid)`: whether a pid is one of this run's (default: its environment names `folder`)."""
    ours = ours or (lambda pid: _ours(pid, folder))
    pids = {r: [p for p in ps if ours(p)] for r, ps in registered(folder).items()}
    before = {}
    for rank, ps in pids.items():
        for pid in ps[:1]:
            path = folder / f"rank{rank}.{pid}.txt"
            before[rank] = (pid, path, path.stat().st_size)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, SIGNAL)
    out: dict[int, RankStack | None] = dict.fromkeys(pids)
    deadline = time.monotonic() + wait_s
    while before and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank, (pid, path, size) in list(before.items()):
            text = path.read_text(encoding="utf-8", errors="replace")[size:]
            if _settled(text, path):
                out[rank] = RankStack(rank, pid, text, main_thread(text))
                del before[rank]
    for rank, (pid, path, size) in before.items():  # slow writers: take what is there
        text = path.read_text(encoding="utf-8", errors="replace")[size:]
        out[rank] = RankStack(rank, pid, text, main_thread(text)) if text else None
    return out


def _settled(text: str, path: Path) -> bool:
    """The dump has begun and the file has not grown for 0.3 s."""
    return "(most recent call first)" in text and time.time() - path.stat().st_mtime > 0.3


def findings(stacks: dict[int, RankStack | None], ranks: list[int]) -> tuple[list[str], list[int]]:
    """Lines that say who did not arrive and where every rank is, and the ranks to blame."""
    got = {r: s for r, s in stacks.items() if s is not None and s.main}
    waiting = [s for s in got.values() if s.collective]
    late = [s for s in got.values() if not s.collective]
    lines = [
        f"rank {r}: no stack (its command is not a Python process that loaded gpufleet's stack hook: "
        "another program, or python -I / -E)"
        for r in ranks
        if r not in stacks
    ]
    lines += [f"rank {r}: its process has ended" for r, s in stacks.items() if s is None]
    if waiting and late:
        lines = [f"rank {s.rank} did not arrive: it is at {s.where}" for s in late] + lines
        blame = [s.rank for s in late]
    elif waiting:
        blame = [r for r, s in stacks.items() if s is None] or [s.rank for s in waiting]
        if not lines:
            lines.append(
                "every rank waits inside a collective: they called different collectives, or the same in a different order"
            )
    else:
        blame = sorted(got)
        if got:
            lines.append(
                "no rank is inside a torch.distributed call (with NCCL a rank waits for a collective at its "
                "next synchronisation, such as .item() or .cpu())"
            )
    lines += [f"rank {s.rank} waits in {s.collective}, called at {s.where}" for s in waiting]
    if not waiting:
        lines += [f"rank {s.rank} is at {s.where}" for s in late]
    return lines, blame


def brief(rank: int, s: RankStack | None, frames: int = 8) -> list[str]:
    """A rank's main thread in a few lines, innermost call first (the whole dump is in the stacks file)."""
    if s is None:
        return []
    more = len(s.main) - frames
    return (
        [f"rank {rank} (pid {s.pid}), main thread, innermost call first:"]
        + [f"  {f.file}:{f.line} in {f.func}" for f in s.main[:frames]]
        + ([f"  ... {more} more"] if more > 0 else [])
    )


def write(stacks: dict[int, RankStack | None], path: Path) -> None:
    """Every rank's dump, whole (every thread), into one file of the run folder."""
    parts = [
        f"=== rank {r} (pid {s.pid})\n{s.text.rstrip()}\n" if s else f"=== rank {r}: its process has ended\n"
        for r, s in sorted(stacks.items())
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")


# --- `gpufleet train`: its ranks register themselves; the one whose collective times out dumps the others


def node_folder(out: Path) -> Path:
    """Where this node's ranks register: OUTPUT/logs/.stacks/<host> (a run folder may be shared by several
    nodes, whose pids mean nothing here)."""
    import socket

    return out / "logs" / ".stacks" / socket.gethostname()


def register_rank(folder: Path, rank: int) -> Path:
    """This process is rank `rank`: its stack goes to FOLDER/rank<R>.<pid>.txt on the signal (an earlier
    attempt's file of the same rank is removed)."""
    from gpufleet.launch.stackhook import register

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"rank{rank}.*.txt"):
        old.unlink(missing_ok=True)
    return Path(register(folder, rank))


def _a_worker(pid: int) -> bool:
    """A live `gpufleet train --worker` process (not a pid reused by another program)."""
    try:
        return pid != os.getpid() and b"--worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def after_timeout(folder: Path, rank: int, e: BaseException, stacks_file: Path) -> list[str]:
    """A collective of rank `rank` timed out with `e`: every other rank's stack on this node now (its own
    is `e`'s traceback), written to `stacks_file`; lines that say who did not arrive, and where each is."""
    import traceback

    frames = [
        Frame(f.filename, f.lineno or 0, f.name) for f in reversed(traceback.extract_tb(e.__traceback__))
    ]
    own = RankStack(rank, os.getpid(), "".join(traceback.format_exception(e)), frames)
    dumped = {**dump(folder, ours=_a_worker), rank: own}
    write(dumped, stacks_file)
    lines, _ = findings(dumped, sorted(dumped))
    return lines + [x for r in sorted(dumped) for x in brief(r, dumped[r])] + [f"every thread: {stacks_file}"]
