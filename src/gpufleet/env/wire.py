"""What both sides of the environment server protocol share (server.py has the full endpoint table).

The protocol: JSON over HTTP, every request carrying `Authorization: Bearer <token>`. GET /health;
POST /reset and /step with {"episodes": [{"id", "seed" | "action"}, ...]} -> {"results": [...]} in
request order; POST /close with {"ids": [...]}. A request has at most MAX_BATCH items; an episode id is a
non-empty string of at most MAX_ID characters (distinct within a /reset or /step). An error is
{"error": "<one line>"} with its status (500 with "env_error": true: the environment raised). A server's ready file and the manager's
servers.json are written atomically (`write_atomic`); clients find the servers and the token through
servers.json (`read_servers_json`). Info dicts cross the wire through `jsonable`.

Standard library only: the server, the manager and the trainer all import this.
"""

from __future__ import annotations

import http.client
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_BATCH = 4096
"""The most episodes (or ids) in one request."""
MAX_ID = 200
"""The longest episode id, in characters."""
_DROP = object()


class EnvServerError(Exception):
    """A server unreachable past the retry window, a non-deterministic replay, or a 4xx (a bug)."""


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (or 'http://host:port', '[::1]:port') -> (host, port)."""
    text = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise EnvServerError(f"environment server address {address!r} is not host:port (e.g. 127.0.0.1:8700)")
    return host.strip("[]"), int(port)


def request(
    conn: http.client.HTTPConnection, method: str, path: str, token: str, body: Any = None
) -> tuple[int, dict]:
    """One JSON request on `conn` -> (status, reply). Transport failures raise OSError/HTTPException."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    try:
        reply = json.loads(raw) if raw else {}
    except ValueError:
        reply = {"error": f"not JSON: {raw[:200]!r}"}
    return resp.status, reply if isinstance(reply, dict) else {"error": f"not a JSON object: {reply!r:.200}"}


def health(address: str, token: str, timeout: float = 5.0) -> dict:
    """GET /health of the server at `address` -> its reply; raises OSError/HTTPException/EnvServerError."""
    host, port = parse_address(address)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        status, reply = request(conn, "GET", "/health", token)
    finally:
        conn.close()
    if status != 200:
        raise EnvServerError(f"env server {address}: /health answered {status}: {reply.get('error')}")
    return reply


def jsonable(value: Any, depth: int = 0) -> Any:
    """`value` as JSON: numpy values -> Python, tuples -> lists, NaN/inf -> None, other objects dropped."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth > 32:
        return _DROP
    if isinstance(value, dict):
        out = {
            str(k): jsonable(v, depth + 1)
            for k, v in value.items()
            if isinstance(k, str | int | float | bool)
        }
        return {k: v for k, v in out.items() if v is not _DROP}
    if isinstance(value, list | tuple):
        return [v for v in (jsonable(x, depth + 1) for x in value) if v is not _DROP]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        try:
            return jsonable(tolist(), depth + 1)
        except Exception:
            return _DROP
    return _DROP


def write_atomic(path: Path, data: dict) -> None:
    """Write JSON so that a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def read_servers_json(path: Path, only: list[int] | None = None) -> tuple[Callable[[], list[str]], str]:
    """(a function re-reading the addresses of servers `only` (default all), the token) of a run's
    servers.json, for EnvPool.from_file; EnvServerError if the file is not one."""

    def servers() -> list[dict]:
        data = json.loads(path.read_text(encoding="utf-8"))
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("servers"), list)
            or "token_file" not in data
        ):
            raise EnvServerError(f"{path} is not a servers.json written by gpufleet (servers, token_file)")
        return data["servers"]

    count = len(servers())
    picked = list(range(count)) if only is None else list(only)
    if not picked or any(not 0 <= i < count for i in picked):
        raise EnvServerError(f"{path} lists {count} servers; there is no server {picked} among them")
    token_file = json.loads(path.read_text(encoding="utf-8"))["token_file"]
    token = Path(token_file).read_text(encoding="utf-8").strip()
    return (lambda: [servers()[i]["address"] for i in picked]), token
