"""Environment servers as real processes on 127.0.0.1 (env/server.py, client.py, servers.py): no mocks.

The pool through servers gives what the same episodes give in process; hostile requests get the right
4xx and the server keeps serving; a server killed with live episodes is restarted and its episodes
replayed with nothing lost or applied twice; stop() and a dead trainer leave no server behind; a user's
environment error comes back as EnvError with the user's file:line.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from gpufleet.env.base import EnvError
from gpufleet.env.client import EnvPool, EnvServerError, LocalPool, health
from gpufleet.env.server import MAX_BATCH, BadRequest, parse_batch
from gpufleet.env.servers import EnvServers
from gpufleet.env.source import factory
from gpufleet.env.wire import jsonable
from gpufleet.errors import UserError

KEYS = "builtin:keys"
DOORS = {"doors": 6}


def answer(observation: str, k: int = 0) -> str:
    """The right letter for a keys door, except every 5th call types digits (ends the episode)."""
    text = observation.strip()
    return "1234" if k % 5 == 4 or not text else text[0] * 4


def play(pool, ids: list[str], seeds: list[int], turns: int, before_turn=None) -> list:
    """Reset `ids`, then step every live episode `turns` times; every call's results, in order."""
    record = [pool.reset(list(zip(ids, seeds, strict=True)))]
    last = {eid: obs for eid, (obs, _) in zip(ids, record[0], strict=True)}
    done: set[str] = set()
    for turn in range(turns):
        if before_turn:
            before_turn(turn)
        live = [eid for eid in ids if eid not in done]
        if not live:
            break
        got = pool.step([(eid, answer(last[eid], k + turn)) for k, eid in enumerate(live)])
        record.append(got)
        for eid, (obs, _, terminated, truncated, _) in zip(live, got, strict=True):
            last[eid] = obs
            if terminated or truncated:
                done.add(eid)
    return record


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(check, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def local(kwargs: dict = DOORS) -> LocalPool:
    return LocalPool(factory(KEYS, kwargs), KEYS)


def test_pool_through_servers_equals_in_process(tmp_path):
    ids, seeds = [f"e{i}" for i in range(10)], list(range(100, 110))
    with EnvServers(KEYS, DOORS, [], 2, tmp_path) as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json)
        assert play(pool, ids, seeds, 8) == play(local(), ids, seeds, 8)
        # least loaded first, ties to the lowest index: 10 episodes -> 5 per server
        assert [_health(a, servers)["episodes"] for a in servers.addresses()] == [5, 5]
        pool.close(ids)
        assert [_health(a, servers)["episodes"] for a in servers.addresses()] == [0, 0]
        assert pool.stats["replays"] == pool.stats["retries"] == 0


def _health(address: str, servers: EnvServers) -> dict:
    return health(address, servers.token_file.read_text().strip())


def test_stop_leaves_no_server_processes(tmp_path):
    servers = EnvServers(KEYS, {}, [], 3, tmp_path, devices=["0", "1"])
    servers.start()
    pids = servers.pids()
    assert all(not gone(p) for p in pids)
    data = json.loads(servers.servers_json.read_text())
    assert [s["pid"] for s in data["servers"]] == pids
    assert [s["device"] for s in data["servers"]] == ["0", "1", "0"]  # one device each, round robin
    assert [psutil.Process(p).environ()["CUDA_VISIBLE_DEVICES"] for p in pids] == ["0", "1", "0"]
    assert oct(servers.token_file.stat().st_mode & 0o777) == "0o600"
    servers.stop()
    servers.stop()  # idempotent
    assert all(gone(p) for p in pids)


# ---- hostile requests against one live server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server started by hand with a small --max-body: (host, port, token)."""
    d = tmp_path_factory.mktemp("server")
    (d / "token").write_text("s3cret-token\n")
    cmd = [sys.executable, "-m", "gpufleet.env.server", "--env", KEYS, "--kwargs", json.dumps(DOORS)]
    cmd += ["--token-file", str(d / "token"), "--ready-file", str(d / "ready"), "--max-body", "4096"]
    cmd += ["--parent-pid", str(os.getpid())]
    with open(d / "log", "wb") as log:
        proc = subprocess.Popen(cmd, stderr=log)
        assert wait_for(lambda: (d / "ready").exists(), 30), (d / "log").read_text()
        ready = json.loads((d / "ready").read_text())
        yield ready["host"], ready["port"], "s3cret-token"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0  # SIGTERM: a clean exit


def call(server, method: str, path: str, body=None, token: str | None = "", raw: bytes | None = None):
    host, port, good = server
    conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {} if token is None else {"Authorization": f"Bearer {token or good}"}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    return resp.status, reply


def reset(server, eid: str = "good", seed: int = 1) -> str:
    status, reply = call(server, "POST", "/reset", {"episodes": [{"id": eid, "seed": seed}]})
    assert status == 200, reply
    return reply["results"][0]["observation"]


HOSTILE = {
    "malformed JSON": (("POST", "/step"), {"raw": b'{"episodes": [{"id": "a"'}, 400, "not JSON"),
    "wrong token": (("GET", "/health"), {"token": "guess"}, 401, "wrong token"),
    "missing token": (("POST", "/reset"), {"token": None, "body": {"episodes": []}}, 401, "no Authorization"),
    "unknown episode": (("POST", "/step"), {"body": {"episodes": [{"id": "nope", "action": "a"}]}}, 404, "'nope'"),
    "seed not int": (("POST", "/reset"), {"body": {"episodes": [{"id": "a", "seed": "x"}]}}, 400, "episodes[0].seed"),
    "seed bool": (("POST", "/reset"), {"body": {"episodes": [{"id": "a", "seed": True}]}}, 400, "episodes[0].seed"),
    "action not str": (("POST", "/step"), {"body": {"episodes": [{"id": "a", "action": 3}]}}, 400, "episodes[0].action"),
    "empty id": (("POST", "/reset"), {"body": {"episodes": [{"id": "", "seed": 1}]}}, 400, "episodes[0].id"),
    "long id": (("POST", "/reset"), {"body": {"episodes": [{"id": "x" * 201, "seed": 1}]}}, 400, "at most 200"),
    "missing field": (("POST", "/step"), {"body": {"episodes": [{"id": "a"}]}}, 400, "episodes[0]"),
    "extra field": (("POST", "/reset"), {"body": {"episodes": [{"id": "a", "seed": 1, "x": 0}]}}, 400, "episodes[0]"),
    "not an object": (("POST", "/reset"), {"body": [1, 2]}, 400, '"episodes"'),
    "episodes not a list": (("POST", "/reset"), {"body": {"episodes": {"id": "a"}}}, 400, "must be a list"),
    "twice in a batch": (
        ("POST", "/reset"), {"body": {"episodes": [{"id": "a", "seed": 1}, {"id": "a", "seed": 2}]}}, 400, "twice",
    ),
    "close ids wrong": (("POST", "/close"), {"body": {"ids": [7]}}, 400, "ids[0]"),
    "oversized body": (("POST", "/reset"), {"raw": b'{"episodes": [' + b" " * 5000 + b"]}"}, 413, "--max-body"),
    "unknown path": (("GET", "/nope"), {}, 404, "/nope"),
    "wrong method": (("GET", "/step"), {}, 405, "/step"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_request_gets_a_clear_4xx_and_the_server_keeps_serving(server, case):
    (method, path), kw, status, words = HOSTILE[case]
    got, reply = call(server, method, path, **kw)
    assert got == status, reply
    assert words in reply["error"] and "\n" not in reply["error"]
    assert call(server, "GET", "/health")[0] == 200
    obs = reset(server)
    status, reply = call(server, "POST", "/step", {"episodes": [{"id": "good", "action": answer(obs)}]})
    assert status == 200 and reply["results"][0]["steps"] == 1


def test_step_after_done_is_409_and_batches_are_all_or_nothing(server):
    reset(server, "ends")
    obs = reset(server, "other")
    assert call(server, "POST", "/step", {"episodes": [{"id": "ends", "action": "1234"}]})[1]["results"][0][
        "terminated"
    ]
    status, reply = call(server, "POST", "/step", {"episodes": [{"id": "ends", "action": "a"}]})
    assert status == 409 and "'ends' has terminated" in reply["error"]
    # one good and one unknown episode: 404, and the good one was not stepped
    batch = [{"id": "other", "action": answer(obs)}, {"id": "ghost", "action": "a"}]
    assert call(server, "POST", "/step", {"episodes": batch})[0] == 404
    status, reply = call(server, "POST", "/step", {"episodes": batch[:1]})
    assert status == 200 and reply["results"][0]["steps"] == 1


def test_batch_limit_and_info_coercion():
    with pytest.raises(BadRequest, match=f"over the limit of {MAX_BATCH}"):
        parse_batch({"episodes": [{"id": str(i), "seed": i} for i in range(MAX_BATCH + 1)]}, "reset")
    info = {"ok": 1, "nan": float("nan"), "obj": object(), "t": (1, 2.5), 3: {"inner": object(), "s": "x"}}
    assert jsonable(info) == {"ok": 1, "nan": None, "t": [1, 2.5], "3": {"s": "x"}}


def test_pool_replays_an_episode_the_server_lost(server):
    """A server that no longer knows an episode (404: restarted between calls) gets it replayed."""
    pool = EnvPool([f"{server[0]}:{server[1]}"], server[2])
    ((obs, _),) = pool.reset([("lost-one", 5)])
    first = pool.step([("lost-one", answer(obs))])
    call(server, "POST", "/close", {"ids": ["lost-one"]})  # behind the pool's back
    again = pool.step([("lost-one", answer(first[0][0]))])
    ref = local()
    ref.reset([("x", 5)])
    ref.step([("x", answer(obs))])
    assert again == ref.step([("x", answer(first[0][0]))])
    assert pool.stats["replays"] == 1


def test_unreachable_server_is_an_env_server_error_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = EnvPool([f"127.0.0.1:{port}"], "t", timeout=1.0, retry_for=0.5)
    with pytest.raises(EnvServerError, match=f"127.0.0.1:{port} has not answered for 0.5 s"):
        pool.reset([("a", 1)])


def test_local_pool_rejects_what_a_server_rejects():
    pool = local()
    with pytest.raises(EnvServerError, match="'a' is not open"):
        pool.step([("a", "x")])
    pool.reset([("a", 1)])
    pool.step([("a", "1234")])
    with pytest.raises(EnvServerError, match="'a' has terminated"):
        pool.step([("a", "x")])


# ---- failures


def test_killed_server_is_restarted_and_episodes_replayed_exactly(tmp_path, capfd):
    ids, seeds = [f"k{i}" for i in range(8)], [7 * i for i in range(8)]
    kwargs = {"doors": 10}
    with EnvServers(KEYS, kwargs, [], 2, tmp_path) as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json, retry_for=60.0)
        victim = servers.pids()[0]

        def kill(turn: int) -> None:
            if turn == 2:
                os.kill(victim, signal.SIGKILL)

        got = play(pool, ids, seeds, 9, before_turn=kill)
        assert got == play(local(kwargs), ids, seeds, 9)
        assert servers.restarts == 1 and gone(victim)
        assert pool.stats["replays"] >= 1 and pool.stats["retries"] >= 1
        assert pool.stats["lost"] == pool.stats["duplicated"] == 0
        listed = json.loads(servers.servers_json.read_text())["servers"]
        assert listed[0]["pid"] == servers.pids()[0] != victim
        assert (
            f"env server 0 was killed by SIGKILL (signal 9); restarted on {servers.addresses()[0]}"
            in capfd.readouterr().err
        )
        pids = servers.pids()
    assert all(gone(p) for p in pids + [victim])


ORPHAN = """
import sys, time
from pathlib import Path
from gpufleet.env.servers import EnvServers
servers = EnvServers("builtin:keys", {}, [], 2, Path(sys.argv[1]))
servers.start()
print(servers.servers_json, flush=True)
time.sleep(600)
"""


def test_servers_of_a_killed_trainer_exit(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        servers_json = Path(child.stdout.readline().strip())
        pids = [s["pid"] for s in json.loads(servers_json.read_text())["servers"]]
        assert all(not gone(p) for p in pids)
    finally:
        child.kill()
        child.wait()
    assert wait_for(lambda: all(gone(p) for p in pids), 10), [p for p in pids if not gone(p)]


USER_ENV = """
import os


class Counter:
    def reset(self, *, seed):
        self.n = seed
        return f"n={self.n}", {"when": object()}

    def step(self, action):
        if action == "boom":
            raise ValueError("the user's environment broke")
        self.n += 1
        return f"n={self.n}", 1.0, False, False, {}


class PerProcess(Counter):
    def reset(self, *, seed):
        self.n = seed
        return f"pid={os.getpid()}", {}
"""


def test_user_env_error_comes_back_with_file_and_line_and_the_server_keeps_serving(tmp_path):
    (tmp_path / "user_envs.py").write_text(textwrap.dedent(USER_ENV))
    line = USER_ENV.splitlines().index('            raise ValueError("the user\'s environment broke")') + 1
    with EnvServers("user_envs:Counter", {}, [str(tmp_path)], 2, tmp_path / "run") as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json)
        assert pool.reset([("a", 10), ("b", 20), ("c", 30)]) == [("n=10", {}), ("n=20", {}), ("n=30", {})]
        with pytest.raises(EnvError, match=rf"user_envs.py:{line}") as err:
            pool.step([("b", "go"), ("c", "go"), ("a", "boom")])  # b on server 1, c applied on server 0,
        assert "ValueError: the user's environment broke" in str(err.value)  # then a raised there
        # a call that raised applied nothing, as the pool sees it: a and b go on from their record
        assert pool.step([("a", "go"), ("b", "go")]) == [
            ("n=11", 1.0, False, False, {}),
            ("n=21", 1.0, False, False, {}),
        ]
        assert pool.stats["replays"] == 2
        assert pool.step([("c", "go")]) == [("n=31", 1.0, False, False, {})]
        assert pool.stats["replays"] == 3 and pool.stats["retries"] == 0


def test_an_env_not_deterministic_given_its_seed_cannot_be_retried(tmp_path):
    (tmp_path / "user_envs.py").write_text(textwrap.dedent(USER_ENV))
    with EnvServers("user_envs:PerProcess", {}, [str(tmp_path)], 1, tmp_path / "run") as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json, retry_for=60.0)
        pool.reset([("a", 1)])
        pool.step([("a", "go")])
        os.kill(servers.pids()[0], signal.SIGKILL)
        with pytest.raises(
            EnvServerError, match="not deterministic given its seed: cannot retry episode 'a'"
        ):
            pool.step([("a", "go")])


def test_a_server_that_cannot_start_is_a_user_error_quoting_its_log(tmp_path):
    with pytest.raises(UserError, match="doors must be a whole number") as err:
        with EnvServers(KEYS, {"doors": 0}, [], 2, tmp_path) as servers:
            servers.start()
    assert err.value.field == "env.name" and "env-server-0.log" in str(err.value)
    assert all(gone(p) for p in servers.pids())


def test_bench_smoke():
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "env_servers.py"), "--servers", "1", "--clients", "1,2"]
    done = subprocess.run(
        [*cmd, "--steps", "10", "--batch", "1,4"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lost + duplicated + wrong = 0" in done.stdout


def test_nodes_sharing_an_output_folder_keep_their_own_server_lists(tmp_path):
    """Two nodes' launchers on one shared output folder: each node's list lies in its own folder, and a
    rank uses the servers of its own node placed for its local device (ranks are node-major)."""
    from types import SimpleNamespace

    from gpufleet.env.connect import server_indices, servers_file

    assert servers_file(tmp_path) == tmp_path / "env" / "servers.json"
    assert servers_file(tmp_path, 1) == tmp_path / "env" / "node1" / "servers.json"
    listing = tmp_path / "servers.json"
    listing.write_text(json.dumps({"servers": [{"index": i} for i in range(4)]}))
    two_nodes = [SimpleNamespace(policy_size=4, policy_index=i) for i in range(4)]
    # 2 nodes x 2 policy ranks, 4 servers per node: local rank 0 -> servers 0, 2; local rank 1 -> 1, 3
    assert [server_indices(listing, rt, nnodes=2) for rt in two_nodes] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [server_indices(listing, rt) for rt in two_nodes] == [[0], [1], [2], [3]]
