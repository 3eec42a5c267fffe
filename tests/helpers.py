"""Shared test helpers: run the CLI in-process and capture its output."""

from __future__ import annotations

from gpufleet.cli import main


def run_cli(capsys, argv, env=None):
    code = main(list(argv), env=env or {})
    out = capsys.readouterr()
    return code, out.out + out.err


def process_env(**extra: str) -> dict:
    """The environment for a gpufleet child process: no job-field variables from the caller, tests/ and
    src/ on PYTHONPATH (for test rewards), one OpenMP thread (2-core machines), then `extra`."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), str(root / "src")])
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = activated_path()
    env.update(extra)
    return env


def activated_path() -> str:
    """PATH as in a shell where the venv is activated: its bin/ first (a bare `python` in a launched
    command is then the venv's, as for a user who installed gpufleet and torch there)."""
    import os
    import sys
    from pathlib import Path

    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])


def run_process(*args: str, cwd, env_extra=None, timeout: int = 300):
    """`python -m gpufleet ARGS` as a real process; tests/ and src/ on PYTHONPATH (for test rewards)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "tests"), str(root / "src"), *(env_extra or {}).get("PYTHONPATH", "").split(os.pathsep)]
    )
    env.update({k: v for k, v in (env_extra or {}).items() if k != "PYTHONPATH"})
    return subprocess.run(
        [sys.executable, "-m", "gpufleet", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def console_script() -> str:
    """The installed `gpufleet` command (the venv's console script), as a user runs it."""
    import shutil
    import sys
    from pathlib import Path

    here = Path(sys.executable).parent / "gpufleet"
    return str(here) if here.exists() else (shutil.which("gpufleet") or "gpufleet")


def run_user(*args: str, cwd, env_extra=None, timeout: int = 300):
    """The installed `gpufleet ARGS` from a user's folder (cwd), with no test paths on PYTHONPATH."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env.pop("PYTHONPATH", None)
    env["PATH"] = activated_path()
    env.update(env_extra or {})
    return subprocess.run(
        [console_script(), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


def sets(*values: str) -> list[str]:
    """`--set a=1 --set b=2` for the given `a=1`, `b=2`."""
    return [x for v in values for x in ("--set", v)]


def gloo_rank(rank: int, port: int, world: int = 2):
    """Rank `rank` of a `world`-process gloo group on this machine (a torch.multiprocessing.spawn worker),
    set up by gpufleet's own init: its Runtime (one node, every rank a policy rank on the CPU)."""
    import os

    from gpufleet import dist as gdist
    from gpufleet.topology import Topology

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return gdist.init(Topology(1, tuple(range(world)), (), cpu=True), cpu=True, timeout_s=120)


def gloo_done() -> None:
    """A spawn worker's clean exit (DESIGN.md: barrier, then destroy the group)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def kill9_after_steps(argv: list[str], run, steps: int, *, cwd, log, env=None, timeout: float = 300) -> None:
    """Start the training command `argv` in its own session, and once `run`/metrics.jsonl has `steps` rows
    kill -9 its whole process group (launcher, torchrun, workers) and reap it. The command's output goes to
    `log` (a path), which the assertion shows if the run ends or stalls first."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    metrics, log = Path(run) / "metrics.jsonl", Path(log)
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or process_env(),
            cwd=cwd,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
