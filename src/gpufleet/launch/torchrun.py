"""Launch N workers through torchrun (`python -m torch.distributed.run`), not a home-made spawner.

`gpufleet train JOB` with more than one process re-executes itself as

    python -m torch.distributed.run --nnodes N --nproc-per-node P [rendezvous] --max-restarts K \\
        --monitor-interval 0.5 -m gpufleet train --worker RUN_DIR/job.yaml --gpus cpu|auto

Workers read the resolved job that the launcher wrote (RUN_DIR/job.yaml), so every rank sees the
same values whatever the environment of the node. Single node: a static rendezvous on
`launch.master_addr:master_port` (`auto` = a free port picked now). Multi-node: c10d rendezvous on
`launch.rdzv_endpoint`. OMP_NUM_THREADS defaults to cores / processes per node.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from gpufleet.config.schema import Job, LaunchSection
from gpufleet.topology import Topology


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host != "localhost" else "127.0.0.1", 0))
        return s.getsockname()[1]


def agent_argv(
    la: LaunchSection,
    nproc_per_node: int,
    run_key: str,
    *,
    node_rank: int | None = None,
    port: int | None = None,
) -> list[str]:
    """torchrun's own part of one node's command (the target follows): nodes, processes, rendezvous."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(la.nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
    ]
    if la.nnodes > 1:
        run_id = hashlib.sha1(run_key.encode()).hexdigest()[:12]
        argv += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            la.rdzv_endpoint or "",
            "--rdzv-id",
            f"gpufleet-{run_id}",
            "--node-rank",
            str(la.node_rank if node_rank is None else node_rank),
            "--rdzv-conf",
            f"join_timeout={la.rendezvous_timeout}",
        ]
    else:
        if port is None:
            port = free_port(la.master_addr) if la.master_port == "auto" else int(la.master_port)
        argv += ["--master-addr", la.master_addr, "--master-port", str(port)]
    return argv + ["--max-restarts", str(la.max_restarts), "--monitor-interval", "0.5"]


def torchrun_argv(
    job: Job,
    topo: Topology,
    job_file: Path,
    *,
    cpu: bool,
    node_rank: int | None = None,
    port: int | None = None,
) -> list[str]:
    """The exact command one node runs for `gpufleet train`."""
    key = str(Path(job.output.dir).resolve())
    argv = agent_argv(job.launch, topo.nproc_per_node, key, node_rank=node_rank, port=port)
    return argv + ["-m", "gpufleet", "train", "--worker", str(job_file), "--gpus", "cpu" if cpu else "auto"]


def worker_env(
    nproc_per_node: int, env: Mapping[str, str] | None = None, cpu_count: int | None = None
) -> dict[str, str]:
    """The ranks' environment: cores / processes threads each (unless set), unbuffered output."""
    env = dict(os.environ if env is None else env)
    cores = cpu_count or os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(nproc_per_node, 1))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def describe_launch(
    job: Job,
    topo: Topology,
    job_file: Path,
    *,
    cpu: bool,
    job_arg: str,
    extra_env: Mapping[str, str] | None = None,
    pythonpath: str | None = None,
    cwd: str | None = None,
) -> str:
    """`--print-launch`: what would run on each node, without running it (`extra_env`: variables gpufleet
    adds for the ranks, such as NCCL_P2P_DISABLE; `pythonpath`: the ranks' PYTHONPATH; `cwd`: the folder
    the command starts in, the launcher's, which relative paths in the job are relative to). With
    `launch.master_port: auto` on one node the command says `--standalone` (torchrun's own rendezvous on a
    free port) rather than a port that is free now and may not be when it runs."""
    lines = []
    nodes = range(job.launch.nnodes)
    for n in nodes:
        if job.launch.nnodes > 1:
            lines.append(f"# node {n}: gpufleet train {job_arg} --set launch.node_rank={n}  (runs:)")
        else:
            lines.append(f"# gpufleet train {job_arg} runs:")
        port = None if job.launch.master_port == "auto" else int(job.launch.master_port)
        argv = torchrun_argv(job, topo, job_file, cpu=cpu, node_rank=n, port=port or 0)
        if job.launch.nnodes == 1 and port is None:  # launch.master_port auto: torchrun picks a free port
            at = argv.index("--master-addr")
            argv[at : at + 4] = ["--standalone"]
        env = worker_env(topo.nproc_per_node)
        added = "".join(f"{k}={shlex.quote(v)} " for k, v in (extra_env or {}).items())
        path = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
        cd = f"cd {shlex.quote(cwd)} && " if cwd else ""
        lines.append(f"{cd}{added}OMP_NUM_THREADS={env['OMP_NUM_THREADS']} {path}" + shlex.join(argv))
    return "\n".join(lines)


class Interrupted(Exception):
    """The launcher was asked to stop (Ctrl-C, SIGINT, SIGTERM); every rank has been stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the agent gets SIGTERM when the launcher dies, even by SIGKILL (it then stops its workers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


STOPPED = -1000  # run_agent's result when `stop_when` said so and the run was stopped on purpose


def run_agent(
    argv: list[str], env: Mapping[str, str], stderr, grace_s: float = 45.0, stop_when=None, on_stop=None
) -> int:
    """Run torchrun's agent in its own process group and wait for it.

    A Ctrl-C at the terminal, or SIGINT / SIGTERM sent to the launcher or its process group, is
    forwarded to the agent exactly once; the agent stops every worker (SIGTERM, then SIGKILL after
    its own timeout) and exits. If it has not exited after `grace_s`, its group is killed. Raises
    `Interrupted` after such a stop, returns the agent's exit code otherwise. With `stop_when` (a
    callable polled twice a second) the run is stopped the same way once it returns True, and STOPPED is
    returned. `on_stop` is called once, just before the agent is told to stop.
    """
    proc = subprocess.Popen(
        argv, env=dict(env), stderr=stderr, start_new_session=True, preexec_fn=die_with_parent
    )
    got: list[int] = []

    def forward(signum, _frame):
        if not got:
            got.append(signum)
            if on_stop is not None:
                on_stop()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = None
    timed_out = False
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop_when is not None and not got and stop_when():
                    timed_out = True
                    got.append(signal.SIGTERM)
                    if on_stop is not None:
                        on_stop()
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                if got and deadline is None:
                    deadline = time.monotonic() + grace_s
                if deadline is not None and time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if timed_out:
        return STOPPED
    if got:
        raise Interrupted(got[0])
    return code
