"""One rank of `gpufleet launch`: run the user's command under torchrun, keep its output per rank.

    python -m gpufleet.launch.rankexec LOGS_DIR [--progress REGEX] [--console FIFO] [--stacks DIR] -- CMD ARGS...

The command runs as written (a bare name through PATH, as a shell would), in a process of its own.
Everything it prints goes to LOGS_DIR/rank<R>.log. Rank 0's stdout also goes to the terminal (inherited);
every rank's stderr goes to the launcher's terminal through the FIFO the launcher reads (`--console`),
rank 0's as it is, the others' with a `[rank R]` prefix. A command that fails leaves
LOGS_DIR/rank<R>.exit.json (exit code, time) so the launcher can name the rank that failed first (a clean
exit: rank<R>.done.json, its time).
SIGINT/SIGTERM from torchrun reach the command; if this process dies, the command gets SIGTERM (no
orphans). With --progress, rank 0's lines that match REGEX (group 1: samples so far) are timestamped into
LOGS_DIR/progress.jsonl (`launch --scaling` reads them). With --stacks, a Python command loads
gpufleet's stack hook (`stackhook`: faulthandler on a signal, one file per process in DIR) so the launcher
can print where every rank is when the run stops making progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _pump(src, log, console, prefix: bytes, lock: threading.Lock, progress=None, stopping=None) -> None:
    """Copy the command's lines to the rank's log and (until the rank is being stopped) to `console`."""
    for line in iter(src.readline, b""):
        with lock:
            log.write(line)
            log.flush()
            if progress is not None:
                progress(line)
        if console is not None and not (stopping is not None and stopping.is_set()):
            try:
                console.write(_shown(prefix, line))
                console.flush()
            except (BrokenPipeError, OSError):  # the launcher is gone: the log still has every line
                console = None


_TORCH_PREFIX = re.compile(rb"^\[rank\d+\]:")


def _shown(prefix: bytes, line: bytes) -> bytes:
    """A line as the terminal shows it: with the rank's prefix unless torch gave it one (`[rank1]:`), and
    ending in a newline (the last line of a process that did not print one)."""
    end = b"" if line.endswith(b"\n") else b"\n"
    return (b"" if _TORCH_PREFIX.match(line) else prefix) + line + end


def _progress_recorder(logs: Path, regex: str | None, rank: int):
    """A line callback that appends {t, samples} to progress.jsonl for lines matching `regex` (rank 0)."""
    if not regex or rank != 0:
        return None
    pattern = re.compile(regex.encode())
    path = logs / "progress.jsonl"
    path.unlink(missing_ok=True)

    def record(line: bytes) -> None:
        m = pattern.search(line)
        if m:
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"t": time.time(), "samples": int(m.group(1))}) + "\n")

    return record


def _console(fifo: str | None):
    """Where this rank's stderr is shown: the launcher's FIFO (its terminal), else this process's stderr."""
    if fifo:
        with contextlib.suppress(OSError):  # ENXIO: no launcher reads it (then torchrun's log)
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "wb", buffering=0)
    return sys.stderr.buffer


def command_env(stacks: str | None) -> dict[str, str]:
    """The command's environment: this rank's, plus (with a stacks folder) the stack hook on PYTHONPATH."""
    env = dict(os.environ)
    if stacks:
        from gpufleet.launch.stackhook import hook_env

        env.update(hook_env(Path(stacks), env.get("PYTHONPATH")))
    return env


def run(
    logs: Path,
    command: list[str],
    progress_regex: str | None = None,
    console: str | None = None,
    stacks: str | None = None,
) -> int:
    from gpufleet.launch.torchrun import die_with_parent

    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"rank{rank}.exit.json").unlink(missing_ok=True)
    (logs / f"rank{rank}.done.json").unlink(missing_ok=True)
    prefix = b"" if rank == 0 else f"[rank {rank}] ".encode()
    with (logs / f"rank{rank}.log").open("ab") as log:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log.write(f"--- rank {rank} start {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {attempt}\n".encode())
        try:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=command_env(stacks),
                preexec_fn=die_with_parent,
            )
        except OSError as e:
            log.write(f"gpufleet: cannot start {command[0]!r}: {e}\n".encode())
            return _record(logs, rank, 127)
        stopping = threading.Event()  # gpufleet stops the ranks: their last words go to the log only

        def forward(signum, _frame) -> None:
            stopping.set()
            proc.send_signal(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, forward)
        lock = threading.Lock()
        out_console = sys.stdout.buffer if rank == 0 else None
        progress = _progress_recorder(logs, progress_regex, rank)
        pumps = [
            threading.Thread(
                target=_pump, args=(proc.stdout, log, out_console, b"", lock, progress, stopping)
            ),
            threading.Thread(
                target=_pump, args=(proc.stderr, log, _console(console), prefix, lock, progress, stopping)
            ),
        ]
        for t in pumps:
            t.start()
        code = proc.wait()
        for t in pumps:
            t.join()
    if code == 0:  # when it ended: a rank that ends early leaves the others waiting (launch/scriptfail.py)
        record = {"rank": rank, "time": time.time()}
        (logs / f"rank{rank}.done.json").write_text(json.dumps(record), encoding="utf-8")
        return 0
    return _record(logs, rank, code)


def _record(logs: Path, rank: int, code: int) -> int:
    """Leave the failure for the launcher; exit like a shell would (128 + signal for a killed command)."""
    record = {"rank": rank, "code": code, "time": time.time()}
    (logs / f"rank{rank}.exit.json").write_text(json.dumps(record), encoding="utf-8")
    return 128 - code if code < 0 else code


def _options(head: list[str]) -> dict[str, str | None]:
    """--progress / --console / --stacks values of the part before `--` (absent ones None)."""
    return {
        k: head[head.index(f"--{k}") + 1] if f"--{k}" in head else None
        for k in ("progress", "console", "stacks")
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    head = args[: args.index("--")]
    o = _options(head)
    sys.exit(run(Path(head[0]), args[args.index("--") + 1 :], o["progress"], o["console"], o["stacks"]))
