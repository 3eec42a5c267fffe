"""A torchrun worker: per-rank log, role dispatch (policy trains, scorer serves), error record.

Every rank writes RUN_DIR/logs/rank<R>.log; only rank 0 also prints to the console. A rank that
raises writes RUN_DIR/logs/rank<R>.error.json (type, message, traceback, whether it is a user error)
before exiting non-zero, so the launcher can name the rank and the cause in one summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from gpufleet.errors import UserError
from gpufleet.fsfaults import fault_error
from gpufleet.paths import user_path


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def rank_log(logs: Path, rank: int, *, console: bool):
    """Write this rank's output to RUN_DIR/logs/rank<R>.log while the block runs. With `console`, the
    output also goes where it went before (the current sys.stdout/stderr, restored afterwards);
    without, everything, C-level output included, goes to the file only (torchrun's other ranks)."""
    logs.mkdir(parents=True, exist_ok=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with (logs / f"rank{rank}.log").open("a", encoding="utf-8", buffering=1) as f:
        f.write(
            f"--- rank {rank} start {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {attempt} pid {os.getpid()}\n"
        )
        before = sys.stdout, sys.stderr
        if console:
            sys.stdout, sys.stderr = _Tee(before[0], f), _Tee(before[1], f)
        else:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            sys.stdout = sys.stderr = f
        try:
            yield f
        finally:
            sys.stdout, sys.stderr = before


def run_worker(job_file: str, gpus: str) -> int:
    from gpufleet import dist
    from gpufleet.config.load import load_job
    from gpufleet.launch.torchrun import die_with_parent

    die_with_parent()  # the torchrun agent dies (even by SIGKILL): this rank stops too, no orphan
    r = load_job(job_file, env={}, anchor=False)  # the launcher's resolved job: no layers, no anchoring again
    job = r.job
    rank, _, local_rank, _ = dist.env_rank()
    out = user_path(job.output.dir)
    logs = out / "logs"
    (logs / f"rank{rank}.error.json").unlink(missing_ok=True)
    hook = _stack_hook(out, rank)
    try:
        with rank_log(logs, rank, console=rank == 0):
            return _run_rank(r, job, out, logs, rank, gpus, Path(job_file) if local_rank == 0 else None)
    finally:
        if hook is not None:
            hook.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                hook.parent.rmdir()  # the last rank of the node to leave removes the folders
                hook.parent.parent.rmdir()


def _keep_job(job_file: Path, out: Path) -> None:
    """A run started from another job file than OUTPUT/job.yaml (the command `gpufleet train --print-launch`
    prints, which reads OUTPUT/print-launch/job.yaml) keeps its job in OUTPUT/job.yaml, as a run the
    launcher started does (`gpufleet watch` / `report` and the checkpoints read it). Atomic."""
    from gpufleet.fsfaults import write_text_atomic

    target = out / "job.yaml"
    if target.exists() and target.resolve() == job_file.resolve():
        return
    write_text_atomic(target, job_file.read_text(encoding="utf-8"))


def _run_rank(r, job, out: Path, logs: Path, rank: int, gpus: str, keep: Path | None = None) -> int:
    from gpufleet import dist
    from gpufleet.hardware import resolve_hardware
    from gpufleet.topology import resolve_topology

    try:
        if keep is not None:  # this node's first rank
            _keep_job(keep, out)
        hw = resolve_hardware(gpus)
        topo, _ = resolve_topology(r, hw)
        offload = job.placement.offload != "none"
        rt = dist.init(topo, cpu=hw.is_cpu, timeout_s=job.launch.collective_timeout, host_collectives=offload)
        print(
            f"rank {rt.rank}/{rt.world_size} ({rt.role}{' ' + '+'.join(rt.roles) if rt.roles else ''}) "
            f"on {rt.device}, node {rt.node_rank}",
            file=sys.stderr if rt.rank else sys.stdout,
            flush=True,
        )
        if rt.role == "scorer":
            from gpufleet.rl.scorer import serve

            serve(rt, job)
        elif rt.role == "rollout":
            from gpufleet.rl import rolloutserve

            rolloutserve.serve(rt, job)
        else:
            _train(rt, job, out)
        dist.shutdown(rt)
        return 0
    except KeyboardInterrupt:  # the launcher was asked to stop: not a failure of this rank
        print(f"rank {rank} stopped: interrupted", file=sys.stderr, flush=True)
        return 130
    except BaseException as caught:
        e = fault_error(caught) or caught  # a full / read-only disk: the user's problem, in one line
        record = {
            "rank": rank,
            "type": type(e).__name__,
            "message": str(e),
            "user_error": isinstance(e, UserError),
            "traceback": traceback.format_exc(),
            "time": time.time(),
            "stacks": _stacks_if_timeout(e, out, logs, rank),
        }
        (logs / f"rank{rank}.error.json").write_text(json.dumps(record), encoding="utf-8")
        traceback.print_exc()
        return 2 if isinstance(e, UserError) else 1


def _stack_hook(out: Path, rank: int) -> Path | None:
    """faulthandler on gpufleet's stack signal, so a rank whose collective times out can show this one's
    stack (launch/stacks.py); the file it writes to (None without a writable temporary folder)."""
    from gpufleet.launch.stacks import node_folder, register_rank

    try:
        return register_rank(node_folder(out), rank)
    except OSError:
        return None


def _stacks_if_timeout(e: BaseException, out: Path, logs: Path, rank: int) -> list[str]:
    """After a collective timed out on this rank: where every rank of this node is (else [])."""
    from gpufleet.launch.scriptfail import TIMEOUT
    from gpufleet.launch.stacks import after_timeout, node_folder

    if not TIMEOUT.search(str(e)):
        return []
    node = int(os.environ.get("GROUP_RANK", "0"))
    name = "stacks.txt" if node == 0 else f"stacks.node{node}.txt"
    try:
        return after_timeout(node_folder(out), rank, e, logs / name)
    except OSError as err:
        return [f"no stacks: {err}"]


def _train(rt, job, out: Path) -> None:
    """A policy rank: train from where the launcher decided (after a torchrun restart: the newest checkpoint)."""
    from gpufleet.rl.resume import worker_start
    from gpufleet.rl.trainer import train

    start = worker_start(job, out)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if start.checkpoint is not None and attempt != "0":  # the launcher announced the first start
        print(f"restart {attempt}: resuming from {start.checkpoint} at step {start.step}", flush=True)
    train(job, out, rt, resume_from=start.checkpoint)
