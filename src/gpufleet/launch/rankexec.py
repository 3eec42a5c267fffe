"""One rank of `gpufleet launch`: run the user's command under torchrun, keep its output per rank.

    python -m gpufleet.launch.rankexec LOGS_DIR [--progress REGEX] -- CMD ARGS...

Everything the command prints goes to LOGS_DIR/rank<R>.log. Rank 0's output also goes to the terminal;
the other ranks' stderr goes there with a `[rank R]` prefix (their errors are seen, their progress is
not repeated N times). A command that fails leaves LOGS_DIR/rank<R>.exit.json (exit code, time) so the
launcher can name the rank that failed first. SIGINT/SIGTERM from torchrun reach the command; if this
process dies, the command gets SIGTERM (no orphans). With --progress, rank 0's lines that match REGEX
(group 1: samples so far) are timestamped into LOGS_DIR/progress.jsonl (`launch --scaling` reads them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _pump(src, log, console, prefix: bytes, lock: threading.Lock, progress=None) -> None:
    for line in iter(src.readline, b""):
        with lock:
            log.write(line)
            log.flush()
            if console is not None:
                console.write(prefix + line)
                console.flush()
            if progress is not None:
                progress(line)


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


def run(logs: Path, command: list[str], progress_regex: str | None = None) -> int:
    from gpufleet.launch.torchrun import die_with_parent

    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"rank{rank}.exit.json").unlink(missing_ok=True)
    prefix = b"" if rank == 0 else f"[rank {rank}] ".encode()
    with (logs / f"rank{rank}.log").open("ab") as log:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log.write(f"--- rank {rank} start {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {attempt}\n".encode())
        try:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=die_with_parent
            )
        except OSError as e:
            log.write(f"gpufleet: cannot start {command[0]!r}: {e}\n".encode())
            return _record(logs, rank, 127)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: proc.send_signal(s))
        lock = threading.Lock()
        out_console = sys.stdout.buffer if rank == 0 else None
        progress = _progress_recorder(logs, progress_regex, rank)
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, log, out_console, b"", lock, progress)),
            threading.Thread(
                target=_pump, args=(proc.stderr, log, sys.stderr.buffer, prefix, lock, progress)
            ),
        ]
        for t in pumps:
            t.start()
        code = proc.wait()
        for t in pumps:
            t.join()
    return _record(logs, rank, code) if code else 0


def _record(logs: Path, rank: int, code: int) -> int:
    """Leave the failure for the launcher; exit like a shell would (128 + signal for a killed command)."""
    record = {"rank": rank, "code": code, "time": time.time()}
    (logs / f"rank{rank}.exit.json").write_text(json.dumps(record), encoding="utf-8")
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    args = sys.argv[1:]
    head = args[: args.index("--")]
    regex = head[head.index("--progress") + 1] if "--progress" in head else None
    sys.exit(run(Path(head[0]), args[args.index("--") + 1 :], regex))
