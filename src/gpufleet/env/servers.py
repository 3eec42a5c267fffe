"""Start, watch, restart and stop the environment servers of a run (`EnvServers`).

    with EnvServers("builtin:keys", {}, folders, count=2, run_dir=out, devices=["0", "1"]) as servers:
        servers.start()                      # every server listening and healthy, or UserError
        pool = EnvPool.from_file(servers.servers_json)
        ...
    # stopped: SIGTERM, 5 s, SIGKILL

Each server is `python -m gpufleet.env.server` (server.py) on a port the OS picks, with the run's token
(run_dir/env/token, mode 0600, `secrets.token_urlsafe(32)`, passed as a file, never on argv), its log in
run_dir/logs/env-server-<i>.log, PYTHONPATH = the job's folders first (module:Class environments import),
CUDA_VISIBLE_DEVICES = devices[i % len(devices)] when devices are given (servers placed per GPU, as VAGEN
does), and --parent-pid this process, so a server whose trainer died exits by itself.

run_dir/env/servers.json -- {"token_file", "servers": [{"index", "address", "pid", "device"}]} -- is what
clients read (EnvPool.from_file); it is rewritten atomically whenever a server is restarted.

A watcher thread polls the servers every 0.25 s; a dead one is restarted (a new port), servers.json
rewritten, one line printed to stderr, `restarts` counted. The clients wait for it and replay their
episodes (client.py). Servers run in their own session: a Ctrl-C in the terminal reaches the trainer,
which stops them in order, not the servers directly.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import gpufleet
from gpufleet.env.runner import DEFAULT_TIMEOUT
from gpufleet.env.wire import health, write_atomic
from gpufleet.errors import UserError
from gpufleet.launch.diagnose import how_it_ended

POLL_S = 0.25
STOP_WAIT_S = 5.0
READY_SLACK_S = 30.0
"""Seconds a server may take to start beyond making its first environment (env.reset_timeout)."""
LOG_LINES = 12


def child_env(folders: list[str]) -> dict[str, str]:
    """The environment of a child Python that imports the user's environments: the job's folders first
    on PYTHONPATH, then this gpufleet, then what was there; unbuffered output."""
    from gpufleet.usercode import pythonpath

    own = str(Path(gpufleet.__file__).resolve().parents[1])  # the children run this gpufleet
    return dict(os.environ, PYTHONPATH=pythonpath([*folders, own], os.environ), PYTHONUNBUFFERED="1")


class _StartFailed(Exception):
    """A server exited or timed out while starting; the message quotes its log."""


class EnvServers:
    """The environment servers of one run (a context manager: stop() on exit)."""

    def __init__(
        self,
        name: str,
        kwargs: dict,
        folders: list[str],
        count: int,
        run_dir: Path,
        devices: list[str] | None = None,
        host: str = "127.0.0.1",
        node: int = 0,
        reset_timeout: float = DEFAULT_TIMEOUT,
    ):
        if count < 1:
            raise ValueError(f"EnvServers needs count >= 1, got {count}")
        self.name, self.kwargs, self.folders, self.count = name, dict(kwargs), list(folders), count
        self.run_dir, self.devices, self.host = Path(run_dir), list(devices or []), host
        self.reset_timeout = reset_timeout  # a server makes one environment before it is ready
        from gpufleet.env.connect import servers_file

        self.servers_json = servers_file(self.run_dir, node)  # nodes sharing the folder: one list each
        self.env_dir = self.servers_json.parent
        self.log_dir = self.run_dir / "logs" if node == 0 else self.run_dir / "logs" / f"node{node}"
        self.token_file = self.env_dir / "token"
        self.restarts = 0
        self._token = ""
        self._procs: list[subprocess.Popen | None] = [None] * count
        self._addresses: list[str] = [""] * count
        self._logs: list[IO[bytes] | None] = [None] * count
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stopped = False

    def __enter__(self) -> EnvServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float | None = None) -> None:
        """Start every server and wait until each is listening and answers /health; UserError (on
        env.name, quoting the server's log) when one exits or is not ready within `timeout` s (default:
        reset_timeout + 30: a server makes one environment first; past reset_timeout it writes the
        stacks of its threads to its log, so the quoted log shows where the constructor is stuck)."""
        timeout = self.reset_timeout + READY_SLACK_S if timeout is None else timeout
        self.env_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._token = secrets.token_urlsafe(32)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(self._token + "\n")
        os.chmod(self.token_file, 0o600)  # an older file keeps its mode through O_CREAT
        for i in range(self.count):
            self._spawn(i)
        deadline = time.monotonic() + timeout
        try:
            for i in range(self.count):
                self._addresses[i] = self._wait_ready(i, deadline)
        except _StartFailed as e:
            self.stop()
            fix = "fix what the log says (env.name, env.kwargs, or the environment's code), then run again"
            raise UserError(str(e), field="env.name", fix=None if "Fix:" in str(e) else fix) from None
        self._write_servers_json()
        self._watcher = threading.Thread(target=self._watch, name="env-servers-watch", daemon=True)
        self._watcher.start()

    def addresses(self) -> list[str]:
        """The servers' 'host:port', by index (a restarted server's new one)."""
        with self._lock:
            return list(self._addresses)

    def pids(self) -> list[int]:
        """The servers' process ids, by index."""
        with self._lock:
            return [p.pid if p else -1 for p in self._procs]

    def stop(self) -> None:
        """Stop watching, SIGTERM every server, wait up to 5 s, SIGKILL the rest. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=STOP_WAIT_S + 5)
        with self._lock:
            procs = [p for p in self._procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            if log is not None:
                log.close()

    def _spawn(self, i: int) -> None:
        """Start server i (its ready file removed first, its log appended to)."""
        ready = self._ready_file(i)
        ready.unlink(missing_ok=True)
        env = child_env(self.folders)
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[i % len(self.devices)]
        cmd = [
            sys.executable,
            "-m",
            "gpufleet.env.server",
            "--env",
            self.name,
            "--kwargs",
            json.dumps(self.kwargs),
        ]
        cmd += [x for folder in self.folders for x in ("--folder", folder)]
        cmd += ["--host", self.host, "--port", "0", "--token-file", str(self.token_file)]
        cmd += ["--ready-file", str(ready), "--parent-pid", str(os.getpid())]
        cmd += ["--timeout", str(self.reset_timeout)]
        if self._logs[i] is None:
            self._logs[i] = open(self._log_file(i), "ab")  # closed by stop()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._logs[i], stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        with self._lock:
            self._procs[i] = proc

    def _wait_ready(self, i: int, deadline: float) -> str:
        """Server i's address once its ready file is there and /health answers; _StartFailed if it
        exits, the deadline passes, or stop() is called."""
        proc, ready = self._procs[i], self._ready_file(i)
        assert proc is not None
        while True:
            code = proc.poll()
            if code is not None:
                raise _StartFailed(self._failure(i, f"{how_it_ended(code)} while starting"))
            if self._stopping.is_set():
                raise _StartFailed(f"env server {i}: stopped while starting")
            address = self._address(ready, proc.pid)
            if address:
                try:
                    health(address, self._token, timeout=5.0)
                    return address
                except Exception:  # listening but not answering yet: keep waiting
                    pass
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise _StartFailed(self._failure(i, "did not become ready in time (env.reset_timeout)"))
            time.sleep(0.05)

    @staticmethod
    def _address(ready: Path, pid: int) -> str:
        try:
            data = json.loads(ready.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return ""
        return f"{data['host']}:{data['port']}" if data.get("pid") == pid else ""

    def _failure(self, i: int, what: str) -> str:
        log = self._log_file(i)
        try:
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_LINES:]
        except OSError:
            lines = []
        quoted = "\n".join(f"    {line}" for line in lines) or "    (the log is empty)"
        return f"env server {i} for {self.name} {what}; the end of its log ({log}):\n{quoted}\n"

    def _watch(self) -> None:
        """Restart dead servers until stop()."""
        while not self._stopping.wait(POLL_S):
            for i in range(self.count):
                proc = self._procs[i]
                if proc is None or proc.poll() is None or self._stopping.is_set():
                    continue
                self._restart(i, proc.returncode)

    def _restart(self, i: int, code: int) -> None:
        self._spawn(i)
        try:
            address = self._wait_ready(i, time.monotonic() + self.reset_timeout + READY_SLACK_S)
        except _StartFailed as e:
            if not self._stopping.is_set():
                print(
                    f"env server {i} {how_it_ended(code)}; restarting it failed: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                self._stopping.wait(1.0)  # then the watcher tries again
            return
        with self._lock:
            self._addresses[i] = address
            self.restarts += 1
        self._write_servers_json()
        print(f"env server {i} {how_it_ended(code)}; restarted on {address}", file=sys.stderr, flush=True)

    def _write_servers_json(self) -> None:
        with self._lock:
            servers = [
                {
                    "index": i,
                    "address": self._addresses[i],
                    "pid": p.pid if p else None,
                    "device": self._device(i),
                }
                for i, p in enumerate(self._procs)
            ]
        data: dict[str, Any] = {"token_file": str(self.token_file.resolve()), "servers": servers}
        write_atomic(self.servers_json, data)

    def _device(self, i: int) -> str | None:
        return self.devices[i % len(self.devices)] if self.devices else None

    def _ready_file(self, i: int) -> Path:
        return self.env_dir / f"server-{i}.ready"

    def _log_file(self, i: int) -> Path:
        return self.log_dir / f"env-server-{i}.log"
