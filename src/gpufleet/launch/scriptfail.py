"""Why a launched script failed: the first rank that exited non-zero, the cause read from its log, and a
computed fix. The causes are recognised by the messages the libraries really print (torch's CUDA OOM,
NCCL, gloo and NCCL collective timeouts, the DataLoader, the OS) and by how the process ended (killed by
SIGKILL). A timeout names the ranks that lagged: those whose logs show no timeout of their own."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpufleet.launch.diagnose import how_it_ended, records
from gpufleet.launch.recipe import Recipe, halved


@dataclass
class Ended:
    rank: int
    code: int
    log: Path
    text: str  # the log of the last attempt, without torch's `[rank1]:` line prefixes
    program: str | None = None  # the program the command ran (the Python a missing module belongs in)
    time: float = 0.0  # when it ended (time.time())


def first_ended(logs: Path) -> Ended | None:
    """The rank whose command failed first (the others usually fail because it did)."""
    ended = records(logs, "rank*.exit.json")
    if not ended:
        return None
    rec = min(ended, key=lambda r: (r["code"] in (-signal.SIGTERM, 143), r["time"]))
    log = logs / f"rank{rec['rank']}.log"
    return Ended(rec["rank"], rec["code"], log, last_attempt(log), time=rec["time"])


_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:[ ]?", re.M)
"""torch prefixes each line of a rank's traceback with `[rank1]:` once init_process_group has run."""


def last_attempt(log: Path) -> str:
    """A rank's log since its last start (torchrun restarts append to the same file), without torch's
    `[rankN]:` prefixes."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    start = text.rfind("--- rank ")
    return _TORCH_PREFIX.sub("", text[start:] if start >= 0 else text)


def _oom(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    if not re.search(r"CUDA out of memory|OutOfMemoryError|HIP out of memory", e.text):
        return None
    smaller = halved(ref, now)
    if smaller:
        return (
            f"out of GPU memory at per-device batch {now.per_device_batch}. Fix: {smaller} (per-device batch "
            f"{now.per_device_batch // 2}, the effective batch stays {ref.effective_batch}), or turn on gradient "
            "checkpointing in the script"
        )
    return (
        "out of GPU memory. Fix: a smaller batch or sequence length, or gradient checkpointing in the script"
    )


def _missing_module(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    m = re.search(r"ModuleNotFoundError: No module named '([^']+)'", e.text)
    if not m:
        return None
    top = m.group(1).split(".")[0]
    where = (
        f"{e.program} -m pip install {top}"
        if e.program and "python" in Path(e.program).name
        else (f"pip install {top} into the Python that runs it")
    )
    return (
        f"the script imports {m.group(1)!r}, which is not installed where it runs. Fix: {where}, or put its "
        "folder on PYTHONPATH, or give the Python that has it: gpufleet launch -- /path/to/venv/bin/python ..."
    )


def _address_in_use(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    if not re.search(r"EADDRINUSE|[Aa]ddress already in use", e.text):
        return None
    return (
        "a port the script (or its rendezvous) binds is already in use. Fix: --set launch.master_port=auto, "
        "or stop the other run that holds it"
    )


# gloo: "Timed out waiting 3000ms for recv operation to complete"; NCCL's watchdog: "Watchdog caught
# collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, ...) ran for 600038 milliseconds".
TIMEOUT = re.compile(r"Timed out waiting \d+ms for (?:recv|send) operation|collective operation timeout")


def _timeout(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    if not TIMEOUT.search(e.text):
        return None
    lagging = []  # the ranks that had not reached the collective: their logs show no timeout
    for log in sorted(e.log.parent.glob("rank*.log"), key=lambda p: int(p.stem[4:] or 0)):
        text = last_attempt(log)
        if not TIMEOUT.search(text):
            last = next((x for x in reversed(text.splitlines()[1:]) if x.strip()), "(no output)")
            lagging.append(f"rank {log.stem[4:]} (its last line: {last.strip()[:120]!r})")
    who = ", ".join(lagging) if lagging else "another rank"
    return (
        f"a collective timed out on rank {e.rank}, waiting for {who}, which lagged or hung before reaching "
        "it. Fix: see what that rank was doing (its log); NCCL_DEBUG=INFO shows the transport; raise the "
        "script's collective timeout only if it is legitimately slow (saving, loading data on one rank)"
    )


def _nccl(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    if "NCCL" not in e.text:
        return None
    if re.search(r"peer access is not supported|cudaErrorPeerAccess|transport/p2p\.cc.*NCCL WARN", e.text):
        return (
            "NCCL failed on peer-to-peer between the GPUs (consumer cards, or a PCIe topology without it). "
            "Fix: NCCL_P2P_DISABLE=1 (gpufleet sets it itself when NVML says the chosen GPUs lack P2P); "
            "NCCL_DEBUG=INFO names the failing transport"
        )
    return (
        "NCCL failed. Fix: on cards without peer-to-peer (consumer GPUs) set NCCL_P2P_DISABLE=1; without "
        "InfiniBand set NCCL_IB_DISABLE=1 (and NCCL_SOCKET_IFNAME=<the interface the nodes share>); "
        "NCCL_DEBUG=INFO names the failing transport"
    )


def _dataloader(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    if not re.search(r"DataLoader worker \(pid", e.text):
        return None
    why = (
        "shared memory (/dev/shm) ran out"
        if re.search(r"shm|shared memory|[Bb]us error", e.text)
        else ("a DataLoader worker was killed (often /dev/shm too small, or host memory)")
    )
    return f"{why}. Fix: fewer DataLoader num_workers per rank, or a larger /dev/shm (docker --shm-size=8g)"


def _killed(e: Ended, ref: Recipe, now: Recipe) -> str | None:
    if e.code not in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return None
    return (
        f"rank {e.rank} was killed by SIGKILL without an error of its own: most often the kernel's "
        "out-of-memory killer (host RAM; `dmesg` says so). Fix: fewer DataLoader workers or a smaller "
        "per-device batch, or fewer processes per node"
    )


CAUSES: list[Callable[[Ended, Recipe, Recipe], str | None]] = [
    _oom,
    _missing_module,
    _address_in_use,
    _timeout,
    _nccl,
    _dataloader,
    _killed,
]


_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset|Broken pipe|DistBackendError|ProcessGroup|gloo|NCCL", re.I
)


def _ended_early(logs: Path, e: Ended, cause: str) -> str | None:
    """A rank that exited 0 before a failure that says a peer was gone: the failing rank was still in a
    collective with it (an ordinary error after another rank's clean end is that error)."""
    if not _PEER_GONE.search(cause):
        return None
    done = sorted(
        (r for r in records(logs, "rank*.done.json") if r["time"] <= e.time), key=lambda r: r["time"]
    )
    if not done:
        return None
    ranks = ", ".join(str(r["rank"]) for r in done)
    return (
        f"rank {ranks} ended (exit code 0) {e.time - done[0]['time']:.0f} s before, while rank {e.rank} still "
        f"ran a collective with it ({cause}). Fix: every rank must run the same collectives to the end: do not "
        "return early on some ranks (end each with dist.barrier(), then dist.destroy_process_group())"
    )


def explain(logs: Path, agent_code: int, ref: Recipe, now: Recipe, program: str | None = None) -> str:
    """The one-paragraph summary printed after a failed launch (`program`: what the command ran)."""
    e = first_ended(logs)
    if e is None:
        return (
            f"gpufleet: the launch failed before any rank ran its command (torchrun exit code {agent_code}); "
            f"see {logs / 'torchrun.log'}"
        )
    e.program = program
    cause = next((c for c in (f(e, ref, now) for f in CAUSES) if c), None)
    if cause is None:
        errors = re.findall(r"^((?:\w+\.)*\w+(?:Error|Exception)\b.*)$", e.text, re.M)
        cause = errors[-1] if errors else f"the command {how_it_ended(e.code)}"
        cause = _ended_early(logs, e, cause) or cause
    tail = [x for x in e.text.splitlines()[1:] if x.strip()][-8:]
    lines = [f"gpufleet: rank {e.rank} failed first: {cause}"]
    if tail:
        lines.append(f"  last lines of {e.log}:")
        lines += [f"    {x}" for x in tail]
    lines.append(f"  every rank was stopped; all logs: {logs}/")
    return "\n".join(lines)
