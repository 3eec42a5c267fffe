"""After a failed multi-process run: which rank failed first, why, and its last log lines."""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path


def how_it_ended(code: int) -> str:
    """A process's exit status in words: "exited with code 3", "was killed by SIGABRT (signal 6)" for a
    negative return code (Python's way of saying a signal ended it), and for 129-192, the shell's way
    (128 + N), "exited with code 134 (128 + 6: killed by SIGABRT?)"."""
    if code < 0:
        return f"was killed by {signal_name(-code)} (signal {-code})"
    if 128 < code <= 128 + 64:
        return f"exited with code {code} (128 + {code - 128}: killed by {signal_name(code - 128)}?)"
    return f"exited with code {code}"


def signal_cause(code: int) -> str:
    """The usual reason a process ends with this exit status ("" when there is none to give)."""
    number = -code if code < 0 else code - 128 if 128 < code <= 128 + 64 else 0
    if number == signal.SIGKILL:
        return "most often the kernel's out-of-memory killer (host RAM; `dmesg` says so)"
    if number in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL):
        return "a crash in native code (C++, CUDA, a library's abort); its log's last lines may say where"
    return ""


def signal_name(number: int) -> str:
    """SIGABRT for 6; "an unnamed signal" for a number this system does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unnamed signal"


# torchrun's failure summary: "rank      : 1 (local_rank: 1)" then "exitcode  : -6 (pid: 4242)"
_AGENT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_AGENT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def agent_exits(agent_log: str) -> list[tuple[int, int]]:
    """(rank, exit code) of each failed worker in torchrun's failure summary (`agent_log`: its text), the
    one under "Root Cause (first observed failure)" first."""
    root = agent_log.rfind("Root Cause")
    first = _exits(agent_log[root:]) if root >= 0 else []
    return first + [e for e in _exits(agent_log) if e not in first]


def _exits(text: str) -> list[tuple[int, int]]:
    out, rank = [], None
    for line in text.splitlines():
        if m := _AGENT_RANK.match(line):
            rank = int(m.group(1))
        elif (m := _AGENT_EXIT.match(line)) and rank is not None:
            out.append((rank, int(m.group(1))))
            rank = None
    return out


@dataclass
class Failure:
    rank: int
    kind: str
    message: str
    user_error: bool
    tail: list[str]
    stacks: list[str] = field(default_factory=list)  # after a collective timeout: where every rank was

    def summary(self, logs: Path, exit_code: int) -> str:
        if self.user_error:
            return f"gpufleet: error: {self.message}"
        lines = [f"gpufleet: rank {self.rank} failed: {self.kind}: {self.message}"]
        lines += [f"  {x}" for x in self.stacks]
        if self.tail:
            lines.append(f"  last lines of {logs / f'rank{self.rank}.log'}:")
            lines += [f"    {x}" for x in self.tail]
        lines.append(f"  every rank was stopped (torchrun exit code {exit_code}); all logs: {logs}/")
        return "\n".join(lines)


def records(logs: Path, pattern: str) -> list[dict]:
    """The JSON records ranks left in `logs` (unreadable or half-written ones skipped)."""
    out = []
    for f in logs.glob(pattern):
        try:
            out.append(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def first_failure(logs: Path, tail: int = 12) -> Failure | None:
    """The earliest error record written by a worker (the root cause; later ones are its echoes)."""
    found = records(logs, "rank*.error.json")
    if not found:
        return None
    # A user error or an injected/real exception beats a peer's "connection closed" that follows it.
    rec = min(found, key=lambda r: (not r.get("user_error"), "Connection" in r.get("message", ""), r["time"]))
    log = logs / f"rank{rec['rank']}.log"
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-tail:] if log.exists() else []
    return Failure(
        rec["rank"],
        rec["type"],
        rec["message"].splitlines()[0] if rec["message"] else "",
        bool(rec.get("user_error")),
        lines,
        list(rec.get("stacks") or []),
    )


PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
    "NCCL communicator was aborted",
)
"""What a rank's collective says when another rank vanished mid-call (gloo, NCCL): an echo, not a cause."""


def killed_rank(failure: Failure | None, agent_log: str) -> tuple[int, int] | None:
    """(rank, exit code) of a rank a signal ended, when that is the root cause: torchrun's summary
    (`agent_log`) shows it, and no rank's error record says more than that its peer was gone."""
    if failure is not None and (failure.user_error or not any(p in failure.message for p in PEER_GONE)):
        return None
    for rank, code in agent_exits(agent_log):
        if (code < 0 or 128 < code <= 128 + 64) and (failure is None or rank != failure.rank):
            return rank, code
    return None


def agent_failure(agent_log: str, launch) -> str | None:
    """A failure of torchrun's own agent (no worker ran or none wrote a record), from its log text:
    a rendezvous that timed out waiting for other nodes, or a rendezvous port already taken."""
    if "RendezvousTimeoutError" in agent_log:
        return (
            f"gpufleet: error: node {launch.node_rank} waited {launch.rendezvous_timeout} s at the rendezvous "
            f"{launch.rdzv_endpoint} and not all {launch.nnodes} nodes arrived; start `gpufleet train` with "
            f"--set launch.node_rank=<n> on every other node (same job, same rdzv_endpoint), or raise "
            f"launch.rendezvous_timeout"
        )
    if "EADDRINUSE" in agent_log or "address already in use" in agent_log.lower():
        where = launch.rdzv_endpoint if launch.nnodes > 1 else f"{launch.master_addr}:{launch.master_port}"
        return (
            f"gpufleet: error: the rendezvous port {where} is already in use on this machine (another run?); "
            "pick a free port (launch.master_port: auto for one node) or stop the other run"
        )
    return None


def unexplained(
    logs: Path, exit_code: int, agent_text: str = "", tail: int = 12, echo: Failure | None = None
) -> str:
    """No error record of the cause: a rank was killed (OOM killer, signal). Which rank and how, from
    torchrun's failure summary in `agent_text` (this run's part of its log), the error `echo` another
    rank recorded because of it (`killed_rank`), and every rank's last lines."""
    text = agent_text
    exits = agent_exits(text)
    if exits:
        rank, code = killed_rank(echo, text) or exits[0]
        cause = signal_cause(code)
        lines = [
            f"gpufleet: rank {rank} {how_it_ended(code)} without an error record (torchrun exit code "
            f"{exit_code})" + (f": {cause}." if cause else ".")
        ]
        if echo is not None:
            lines.append(f"  then rank {echo.rank} failed: {echo.kind}: {echo.message} (its peer was gone)")
    else:
        lines = [
            f"gpufleet: a worker died without an error record (torchrun exit code {exit_code}); "
            "likely killed by a signal (out of memory?)."
        ]
    for log in sorted(logs.glob("rank*.log")):
        body = log.read_text(encoding="utf-8", errors="replace").splitlines()[-3:]
        lines.append(f"  {log.name}: " + (" | ".join(body) if body else "(empty)"))
    return "\n".join(lines)
