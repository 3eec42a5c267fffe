"""Environment calls that hang or crawl: env.step_timeout / env.reset_timeout, in the trainer (env.servers:
0) and on servers, with real hangs (time.sleep in the user's env file) and short limits. The run says what
it waits for, then stops with one line naming the class, the method, the episode, the action, the server
that is stuck and the env's file:line; an env that is slow on purpose runs with a longer limit."""

from __future__ import annotations

import json
import textwrap
import time

import psutil
import pytest

from gpufleet.env.client import EnvPool, LocalPool, health
from gpufleet.env.runner import EnvTimeout
from gpufleet.env.servers import EnvServers
from gpufleet.env.source import factory

HANG = textwrap.dedent(
    """\
    import os
    import time


    class Hang:
        def __init__(self, claim="", hang_in="step", seconds=600):
            self.claim, self.hang_in, self.seconds = claim, hang_in, seconds
            if hang_in == "init":
                time.sleep(seconds)

        def reset(self, *, seed):
            self.t = 0
            if self.hang_in == "reset":
                time.sleep(self.seconds)
            return "go:", {}

        def step(self, action):
            self.t += 1
            if self.hang_in == "step" and self.t == 2 and self._claim():
                time.sleep(self.seconds)
            return "\\ngo:", 0.5, False, False, {}

        def _claim(self):  # the first process to get here hangs (it writes its pid)
            if not self.claim:
                return True
            try:
                fd = os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return True
    """
)
_SLEEPS = [n + 1 for n, line in enumerate(HANG.splitlines()) if "time.sleep(" in line]
INIT_LINE, RESET_LINE, STEP_LINE = _SLEEPS  # the lines where each hang sleeps


def write_env(folder) -> None:
    (folder / "my_env.py").write_text(HANG)


def job(folder, **env) -> None:
    env = {"name": "my_env.py:Hang", "max_turns": 3, "max_action_tokens": 2} | env
    (folder / "job.yaml").write_text(
        f"env: {json.dumps(env)}\nrollout: {{max_prompt_length: 8}}\n"
        "train: {per_device_batch: 16, max_steps: 2}\noutput: {dir: out}\n"
    )


@pytest.mark.slow  # ~12-20 s each: a trainer that starts, hangs 3 s and stops
@pytest.mark.parametrize("servers", [0, 2])
def test_a_hanging_step_stops_the_run_with_one_line_naming_it(tmp_path, servers):
    """The installed CLI from the user's folder: a heartbeat, then one line with the class, the method,
    the episode, the action, the right server and my_env.py's line; no server left behind."""
    from helpers import run_user

    write_env(tmp_path)
    claim = tmp_path / "claim"
    job(tmp_path, kwargs={"claim": str(claim)}, servers=servers, step_timeout=3)
    start = time.monotonic()
    p = run_user("train", "job.yaml", "--gpus", "cpu", cwd=tmp_path, timeout=120)
    took = time.monotonic() - start
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    error = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(error) == 1, p.stderr
    assert "env.step_timeout" in error[0] and "Hang.step (episode g0r" in error[0], error[0]
    assert "action '" in error[0] and f"my_env.py:{STEP_LINE}" in error[0], error[0]
    assert "--set env.step_timeout=12" in error[0] and "retry_for" not in p.stderr, error[0]
    assert "waiting for Hang.step (episode g0r" in p.stderr, p.stderr
    assert took < 60, took  # not the old 60 s request timeout + 120 s retry window
    if servers:
        listing = json.loads((tmp_path / "out" / "env" / "servers.json").read_text())["servers"]
        stuck = next(s["index"] for s in listing if s["pid"] == int(claim.read_text()))
        assert f"on env server {stuck} (" in error[0], error[0]
        assert all(not psutil.pid_exists(s["pid"]) for s in listing)


def test_the_pool_of_a_second_rank_names_the_server_by_its_index_in_the_run(tmp_path):
    """A rank using only server 1 (only=[1]) names server 1, and its log; /health says what is busy;
    the heartbeat names the call; a later request is answered at once with the same stuck call."""
    write_env(tmp_path)
    with EnvServers("my_env:Hang", {}, [str(tmp_path)], 2, tmp_path / "run") as servers:
        servers.start()
        said: list[str] = []
        pool = EnvPool.from_file(servers.servers_json, only=[1], step_timeout=2.0, say=said.append)
        pool.reset([("a", 1)])
        pool.step([("a", "first")])
        start = time.monotonic()
        with pytest.raises(EnvTimeout) as err:
            pool.step([("a", "second")])
        assert 1.9 < time.monotonic() - start < 10
        text = str(err.value)
        assert "Hang.step (episode a, action 'second') on env server 1 (" in text, text
        assert f"env.step_timeout 2 s; it is stuck at {tmp_path / 'my_env.py'}:{STEP_LINE}" in text, text
        waiting = [
            s for s in said if "waiting for Hang.step (episode a, action 'second') on env server 1" in s
        ]
        assert waiting and waiting[0].endswith(" (limit 2 s)"), said  # as the in-trainer line says it
        token = servers.token_file.read_text().strip()
        busy = health(servers.addresses()[1], token)["busy"]
        assert busy["call"] == "Hang.step (episode a, action 'second')" and busy["for"] >= 2
        assert health(servers.addresses()[0], token)["busy"] is None
        start = time.monotonic()
        with pytest.raises(EnvTimeout, match="action 'second'"):
            pool.reset([("b", 2)])  # queued behind the stuck call: answered now, never run
        assert time.monotonic() - start < 2


def test_in_process_limits_bound_making_resetting_and_stepping(tmp_path, monkeypatch):
    """LocalPool: a hanging constructor and reset are env.reset_timeout's, a step env.step_timeout's;
    an env slower than the limit works once the limit is raised."""
    write_env(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "my_env.py"

    def pool(limit: float, **kwargs) -> LocalPool:
        make = factory("my_env:Hang", kwargs, [str(tmp_path)])
        return LocalPool(make, "my_env:Hang", reset_timeout=limit, step_timeout=limit, say=lambda _: None)

    with pytest.raises(
        EnvTimeout, match=rf"Hang.__init__ \(episode a, seed 1\).*reset_timeout 0.5 s.*:{INIT_LINE}"
    ):
        pool(0.5, hang_in="init").reset([("a", 1)])
    with pytest.raises(
        EnvTimeout, match=rf"Hang.reset \(episode a, seed 1\).*reset_timeout 0.5 s.*{path}:{RESET_LINE}"
    ):
        pool(0.5, hang_in="reset").reset([("a", 1)])
    slow = pool(0.5, seconds=1.0)
    slow.reset([("a", 1)])
    slow.step([("a", "x")])
    with pytest.raises(
        EnvTimeout, match=rf"Hang.step \(episode a, action 'y'\).*step_timeout 0.5 s.*:{STEP_LINE}"
    ):
        slow.step([("a", "y")])
    patient = pool(5.0, seconds=1.0)  # slow on purpose: a longer limit
    patient.reset([("a", 1)])
    assert [r[0] for r in patient.step([("a", "x")]) + patient.step([("a", "y")])] == ["\ngo:", "\ngo:"]


def test_a_server_whose_constructor_hangs_quotes_where_in_its_log(tmp_path):
    """A server makes one environment before it is ready; past env.reset_timeout it writes its stack to
    its log, and the start failure quotes it (the constructor's file:line)."""
    from gpufleet.errors import UserError

    write_env(tmp_path)
    servers = EnvServers(
        "my_env:Hang", {"hang_in": "init"}, [str(tmp_path)], 1, tmp_path / "run", reset_timeout=1
    )
    with pytest.raises(UserError, match="did not become ready in time") as err:
        with servers:
            servers.start(timeout=4)
    assert f'my_env.py", line {INIT_LINE} in __init__' in str(err.value), str(err.value)
    assert all(not psutil.pid_exists(p) for p in servers.pids())
