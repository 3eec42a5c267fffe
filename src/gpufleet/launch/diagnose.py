"""After a failed multi-process run: which rank failed first, why, and its last log lines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Failure:
    rank: int
    kind: str
    message: str
    user_error: bool
    tail: list[str]

    def summary(self, logs: Path, exit_code: int) -> str:
        if self.user_error:
            return f"gpufleet: error: {self.message}"
        lines = [f"gpufleet: rank {self.rank} failed: {self.kind}: {self.message}"]
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
    )


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


def unexplained(logs: Path, exit_code: int, tail: int = 12) -> str:
    """No error record: a rank was killed (OOM killer, signal). Show every rank's last lines."""
    lines = [
        f"gpufleet: a worker died without an error record (torchrun exit code {exit_code}); "
        "likely killed by a signal (out of memory?)."
    ]
    for log in sorted(logs.glob("rank*.log")):
        body = log.read_text(encoding="utf-8", errors="replace").splitlines()[-3:]
        lines.append(f"  {log.name}: " + (" | ".join(body) if body else "(empty)"))
    return "\n".join(lines)
