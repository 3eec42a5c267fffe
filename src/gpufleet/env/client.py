"""The trainer's side of the environment servers: `EnvPool` (HTTP); `LocalPool` (in process, table.py).

    pool.reset([(id, seed), ...])   -> [(observation, info), ...]                              in input order
                                    (or (id, seed, options): Gymnasium's reset options, a JSON object)
    pool.step([(id, action), ...])  -> [(observation, reward, terminated, truncated, info), ...]
    pool.close([id, ...])

EnvPool puts a new episode on the server with the fewest live episodes of this pool (ties: the lowest
index) and sends one batch per server per call, servers in parallel (threads, keep-alive http.client).
It records each live episode's seed, actions and results. The guarantee: a server that cannot be
reached (refused, reset, timeout) or answers a 5xx that is not an environment error is waited for,
re-reading the addresses (a restarted server has a new port), up to `retry_for` s (then EnvServerError);
then the episodes of the failed request are REPLAYED on it -- reset(seed), the recorded actions in order,
each result checked against the record (not deterministic given its seed: EnvServerError) -- and the
pending request is sent again. A server that no longer knows an episode (404) gets it replayed too. So
no episode is dropped and no step applied twice; the server echoes each episode's step count and the
pool checks it (stats lost / duplicated). A call that raises applied nothing as the pool sees it: the
episodes of a failed step call are replayed from the record before their next use, those of a failed
reset must be reset again. An environment error (500 with env_error) raises `base.EnvError`, not
retried; any other 4xx is a bug: EnvServerError. An EnvPool serves one caller at a time (a lock).

Deadlines: every request tells the server how long each environment call may take (`reset_timeout`,
`step_timeout`: env.reset_timeout / env.step_timeout); the server answers a call past it with the call,
its class, episode, action and file:line (`runner.EnvTimeout`, raised here naming the server by its index
in the run, as its log file is named). The socket waits that long per episode of the batch plus `timeout`
s. While a call is slow the pool says so (one heartbeat thread), naming the call the server reports busy.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.env.base import EnvError
from gpufleet.env.runner import DEFAULT_TIMEOUT, EnvTimeout, Heartbeat, stderr
from gpufleet.env.table import STATS, LocalPool, check_distinct
from gpufleet.env.wire import EnvServerError, health, parse_address, read_servers_json, request
from gpufleet.watchdog import HEARTBEAT_FIRST

__all__ = ["STATS", "EnvPool", "EnvServerError", "LocalPool", "health", "parse_address", "request"]

IDLE_RECONNECT_S = 30.0
"""A keep-alive connection idle this long is replaced before use (servers close idle connections)."""


class _Down(Exception):
    """The server could not answer this request (transport failure or a 5xx that is not an env error)."""


@dataclass
class _Episode:
    seed: int
    server: int
    options: dict | None = None  # reset(seed=, options=), replayed with the seed
    actions: list[str] = field(default_factory=list)
    results: list[tuple] = field(default_factory=list)  # (obs,) of reset, then (obs, reward, term, trunc)
    stale: bool = False  # the server's copy may differ from this record: replay before the next use


class _Conn:
    def __init__(self, address: str, timeout: float):
        self.address, self.used = address, time.monotonic()
        host, port = parse_address(address)
        self.http = http.client.HTTPConnection(host, port, timeout=timeout)


class EnvPool:
    """Episodes spread over environment servers, replayed from their seed when a server fails."""

    def __init__(
        self,
        addresses: list[str] | Callable[[], list[str]],
        token: str,
        *,
        timeout: float = 30.0,
        retry_for: float = 120.0,
        reset_timeout: float = DEFAULT_TIMEOUT,
        step_timeout: float = DEFAULT_TIMEOUT,
        labels: list[int] | None = None,
        say: Callable[[str], None] = stderr,
    ):
        """`timeout`: seconds a server may take to answer beyond its environment calls' limits;
        `labels`: each address's server index in the run (default 0, 1, ...), as messages name them."""
        self._source = addresses if callable(addresses) else (lambda: list(addresses))
        self._addresses = list(self._source())
        if not self._addresses:
            raise EnvServerError("EnvPool needs at least one environment server address")
        for address in self._addresses:
            parse_address(address)  # a malformed one fails now, not at the first failure
        self.token, self.timeout, self.retry_for = token, timeout, retry_for
        self.limits = {"/reset": reset_timeout, "/step": step_timeout, "/close": step_timeout}
        self.labels, self._beat = list(labels or range(len(self._addresses))), Heartbeat(say)
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        self.says_success = False  # an info of this pool's has had a "success" key (rl/episodes.py)
        self._episodes: dict[str, _Episode] = {}
        self._load = [0] * len(self._addresses)
        self._conns: dict[int, _Conn] = {}
        self._lock, self._stats_lock = threading.Lock(), threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_file(cls, servers_json: Path, only: list[int] | None = None, **kw: Any) -> EnvPool:
        """The servers listed in the manager's servers.json (`only`: those indices), re-read on failure;
        the token from the token file named there."""
        addresses, token = read_servers_json(Path(servers_json), only)
        return cls(addresses, token, labels=only, **kw)

    def reset(self, items: list[tuple]) -> list[tuple[str, dict]]:
        """Start (or restart) episodes: (id, seed) or (id, seed, options) -> (observation, info), in
        input order."""
        check_distinct([item[0] for item in items])
        for eid, seed, *_ in items:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise TypeError(f"episode {eid!r}: seed must be an int, got {seed!r}")
        with self._lock:
            body = []
            for eid, seed, *options in items:
                old = self._episodes.get(eid)
                server = old.server if old else self._least_loaded()
                if not old:
                    self._load[server] += 1
                self._episodes[eid] = ep = _Episode(seed, server, options[0] if options else None, stale=True)
                body.append(_reset_item(eid, ep))
            out = self._call("/reset", body, self._reset_done)
            return [(r["observation"], r["info"]) for r in out]

    def step(self, items: list[tuple[str, str]]) -> list[tuple[str, float, bool, bool, dict]]:
        """Apply one action per episode -> (observation, reward, terminated, truncated, info)."""
        check_distinct([i for i, _ in items])
        with self._lock:
            for eid, action in items:
                if eid not in self._episodes:
                    raise EnvServerError(f"episode {eid!r} was not reset by this pool (or was closed)")
                if not self._episodes[eid].results:
                    raise EnvServerError(f"episode {eid!r}: its reset failed; reset it again before stepping")
                if not isinstance(action, str):
                    raise TypeError(f"episode {eid!r}: action must be str, got {type(action).__name__}")
            body = [{"id": eid, "action": action} for eid, action in items]
            out = self._call("/step", body, self._step_done)
            self.says_success = self.says_success or any("success" in r["info"] for r in out)
            return [(r["observation"], r["reward"], r["terminated"], r["truncated"], r["info"]) for r in out]

    def close(self, ids: list[str]) -> None:
        """Free the episodes (unknown ids are ignored)."""
        with self._lock:
            groups: dict[int, list[str]] = {}
            for eid in dict.fromkeys(ids):
                ep = self._episodes.pop(eid, None)
                if ep is not None:
                    self._load[ep.server] -= 1
                    groups.setdefault(ep.server, []).append(eid)
            for server, group in groups.items():
                for _ in range(2):  # a stale keep-alive connection gets one more try; a server that is
                    try:  # down has lost them anyway
                        self._send(server, "/close", {"ids": group})
                        break
                    except _Down:
                        pass

    def shutdown(self) -> None:
        """Close the connections and the worker threads (the pool can still be used afterwards)."""
        for conn in self._conns.values():
            conn.http.close()
        self._conns.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def _least_loaded(self) -> int:
        return min(range(len(self._load)), key=lambda i: (self._load[i], i))

    def _call(self, path: str, items: list[dict], done: Callable[[dict, dict], str | None]) -> list[dict]:
        """One batch request per server, in parallel; `done(item, result)` records each result (and
        says what is wrong with it, if anything)."""
        groups: dict[int, list[int]] = {}
        for k, item in enumerate(items):
            groups.setdefault(self._episodes[item["id"]].server, []).append(k)

        def run(server: int) -> list[dict] | Exception:
            try:
                return self._exchange(server, path, [items[k] for k in groups[server]])
            except (EnvError, EnvServerError) as e:
                return e

        first = min(HEARTBEAT_FIRST, self.limits[path] / 2)
        with self._beat.watching(_Busy(self, path, sorted(groups)), first, self.limits[path]):
            if len(groups) > 1:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(len(self._addresses), thread_name_prefix="envpool")
                replies = dict(zip(groups, self._executor.map(run, groups), strict=True))
            else:
                replies = {server: run(server) for server in groups}
        errors = [replies[s] for s in sorted(groups) if isinstance(replies[s], Exception)]
        if errors:  # applied nothing, as this pool sees it: replay (step) or reset again (reset)
            for item in items:
                self._episodes[item["id"]].stale = True
            raise errors[0]
        results: list[dict] = [{}] * len(items)
        for server, ks in groups.items():
            for k, result in zip(ks, replies[server], strict=True):
                results[k] = result
                wrong = done(items[k], result)
                errors += [EnvServerError(wrong)] if wrong else []
        if errors:
            raise errors[0]
        return results

    def _reset_done(self, item: dict, result: dict) -> None:
        ep = self._episodes[item["id"]]
        ep.results.append((result["observation"],))
        ep.stale = False

    def _step_done(self, item: dict, result: dict) -> str | None:
        eid, ep = item["id"], self._episodes[item["id"]]
        ep.actions.append(item["action"])
        ep.results.append(_step_key(result))
        steps = result.get("steps", len(ep.actions))
        if steps != len(ep.actions):
            with self._stats_lock:
                self.stats["lost" if steps < len(ep.actions) else "duplicated"] += 1
            ep.stale = True
            return (
                f"{self.name(ep.server)} has applied {steps} steps to "
                f"episode {eid!r}, this pool {len(ep.actions)}: a step was lost or applied twice (a bug)"
            )
        return None

    def _exchange(self, server: int, path: str, items: list[dict]) -> list[dict]:
        """Send one batch to `server`, waiting for it and replaying its episodes after a failure."""
        ids = [item["id"] for item in items]
        deadline: float | None = None
        replayed_missing = False
        while True:
            try:
                if path == "/step":
                    self._replay(server, [eid for eid in ids if self._episodes[eid].stale])
                status, reply = self._send(server, path, {"episodes": items})
            except _Down as e:
                self._count("retries")
                for eid in ids:
                    self._episodes[eid].stale = True
                deadline = deadline or time.monotonic() + self.retry_for
                if time.monotonic() > deadline:  # healthy, yet this request keeps failing (e.g. timeouts)
                    raise EnvServerError(
                        f"{self.name(server)} kept failing {path} for {self.retry_for:g} s: {e}. Check its "
                        f"log (OUTPUT/logs/env-server-{self.labels[server]}.log)"
                    ) from None
                self._wait_healthy(server, deadline, str(e))
                continue
            if status == 200 and isinstance(reply.get("results"), list) and len(reply["results"]) == len(ids):
                return reply["results"]
            if status == 404 and path == "/step" and not replayed_missing:  # the server was restarted
                replayed_missing = True
                for eid in ids:
                    self._episodes[eid].stale = True
                continue
            for eid in ids:
                self._episodes[eid].stale = True
            if reply.get("env_error") and isinstance(reply.get("timeout"), dict):
                raise EnvTimeout(reply["timeout"], server=self.name(server))
            if reply.get("env_error"):
                raise EnvError(str(reply.get("error")))
            raise EnvServerError(
                f"{self.name(server)} answered {path} with {status}: {reply.get('error', reply)}"
            )

    def _replay(self, server: int, ids: list[str]) -> None:
        """Rebuild episodes `ids` on `server` from the record: reset(seed), then the actions in order,
        each result checked against the recorded one."""
        if not ids:
            return
        eps = {eid: self._episodes[eid] for eid in ids}
        rounds = [[_reset_item(eid, ep) for eid, ep in eps.items()]]
        for k in range(max(len(ep.actions) for ep in eps.values())):
            rounds.append(
                [{"id": eid, "action": ep.actions[k]} for eid, ep in eps.items() if len(ep.actions) > k]
            )
        for k, batch in enumerate(rounds):
            status, reply = self._send(server, "/step" if k else "/reset", {"episodes": batch})
            if status == 500 and isinstance(reply.get("timeout"), dict):
                raise EnvTimeout(reply["timeout"], server=self.name(server))
            if status != 200:
                raise EnvServerError(
                    f"replaying {len(ids)} episodes on {self.name(server)} failed ({status}: "
                    f"{reply.get('error')}): is the environment deterministic given its seed?"
                )
            for item, result in zip(batch, reply["results"], strict=True):
                now, recorded = (
                    _step_key(result) if k else (result["observation"],),
                    eps[item["id"]].results[k],
                )
                if now != recorded:
                    raise EnvServerError(
                        f"environment is not deterministic given its seed: cannot retry episode {item['id']!r}"
                        f" after {self.name(server)} failed ({'step ' + str(k) if k else 'reset'} gave "
                        f"{now!r:.100}, first {recorded!r:.100}). Fix: make reset(seed=...) and step() depend "
                        "only on the seed and the actions (seed every random generator in reset), or set "
                        "env.servers: 0 (no servers, no retries)"
                    )
        for ep in eps.values():
            ep.stale = False
        self._count("replays", len(ids))

    def name(self, server: int) -> str:
        """'env server <index in the run> (<address>)'."""
        return f"env server {self.labels[server]} ({self._addresses[server]})"

    def _send(self, server: int, path: str, body: dict) -> tuple[int, dict]:
        """One POST to `server`; _Down for a transport failure or a 5xx that is not an env error."""
        address = self._addresses[server]
        conn = self._conns.get(server)
        if conn is None or conn.address != address or time.monotonic() - conn.used > IDLE_RECONNECT_S:
            if conn is not None:
                conn.http.close()
            conn = self._conns[server] = _Conn(address, self.timeout)
        limit = self.limits[path]
        n = len(body.get("episodes", body.get("ids", [])))  # a reset: making the env, then its reset
        wait = (2 if path == "/reset" else 1) * max(n, 1) * limit + self.timeout
        conn.http.timeout = wait
        if conn.http.sock is not None:
            conn.http.sock.settimeout(wait)
        body = body | {"timeout": limit}
        self._count("requests")
        try:
            status, reply = request(conn.http, "POST", path, self.token, body)
        except (OSError, http.client.HTTPException) as e:
            conn.http.close()
            self._conns.pop(server, None)
            raise _Down(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        conn.used = time.monotonic()
        if status >= 500 and not reply.get("env_error"):
            raise _Down(f"HTTP {status}: {reply.get('error')}")
        if status == 401:
            raise EnvServerError(f"{self.name(server)} refused the token: {reply.get('error')}")
        return status, reply

    def _wait_healthy(self, server: int, deadline: float, why: str) -> None:
        """Back off and re-read the addresses until `server` answers /health; EnvServerError past the
        deadline."""
        pause = 0.05
        while True:
            time.sleep(pause)
            pause = min(pause * 2, 2.0)
            try:
                fresh = list(self._source())
                if len(fresh) == len(self._addresses):
                    self._addresses = fresh
            except (OSError, ValueError, LookupError, EnvServerError):
                pass  # servers.json being rewritten or gone: keep the last addresses
            try:
                health(self._addresses[server], self.token, timeout=min(self.timeout, 5.0))
                return
            except (OSError, http.client.HTTPException, EnvServerError) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if time.monotonic() > deadline:
                raise EnvServerError(
                    f"env server {self.labels[server]} at {self._addresses[server]} has not answered for "
                    f"{self.retry_for:g} s ({why}). Check that it is running and its log "
                    f"(OUTPUT/logs/env-server-{self.labels[server]}.log)"
                )

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n


class _Busy:
    """What a heartbeat says the pool waits for: the call a server of the request reports running."""

    def __init__(self, pool: EnvPool, path: str, servers: list[int]):
        self.pool, self.path, self.servers = pool, path, servers

    def __str__(self) -> str:
        for server in self.servers:
            try:
                busy = health(self.pool._addresses[server], self.pool.token, timeout=1.0).get("busy")
            except (OSError, http.client.HTTPException, EnvServerError):
                return f"{self.pool.name(server)} ({self.path}; it does not answer /health)"
            if busy:
                return f"{busy['call']} on {self.pool.name(server)}"
        return ", ".join(self.pool.name(s) for s in self.servers) + f" ({self.path})"


def _step_key(result: dict) -> tuple:
    return (result["observation"], result["reward"], result["terminated"], result["truncated"])


def _reset_item(eid: str, ep: _Episode) -> dict:
    """A /reset item: the id, the seed, and the options when the episode has some."""
    return {"id": eid, "seed": ep.seed} | ({} if ep.options is None else {"options": ep.options})
