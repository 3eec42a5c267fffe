"""One environment server process: a run's environments behind batch HTTP endpoints.

    python -m gpufleet.env.server --env NAME [--kwargs JSON] [--folder DIR]... [--host 127.0.0.1]
        [--port 0] --token-file PATH --ready-file PATH [--parent-pid PID] [--max-body BYTES] [--timeout S]

    GET  /health  -> {"ok": true, "env", "episodes": <live>, "pid", "busy": null | {"call", "for"}}
    POST /reset   {"episodes": [{"id", "seed"}, ...]}   -> {"results": [{"id", "observation", "info"}]}
                  (an item may add "options": an object, passed as reset(seed=, options=), Gymnasium's)
    POST /step    {"episodes": [{"id", "action"}, ...]} -> {"results": [{"id", "observation", "reward",
                                                            "terminated", "truncated", "info", "steps"}]}
    POST /close   {"ids": [...]}                         -> {"closed": n}

A /reset, /step or /close body may add "timeout": the seconds each environment call of it may take (the
client sends env.reset_timeout / env.step_timeout; default --timeout, 600). The environments run on a
thread of their own (runner.py), so the server keeps answering while one is slow: /health says which call
runs and for how long, the log gets a heartbeat, and a call past its limit is answered with 500
`{"env_error": true, "timeout": {"name", "call", "method", "limit", "where"}}` -- where: the
environment's file:line, read from that thread's stack. A stuck call is not interrupted: later requests
are answered with the same timeout at once, until it returns.

Every request carries `Authorization: Bearer <token>`; the token is read from a file (never argv) and
compared in constant time. Results come in request order; `steps` is the episode's step count since its
reset (the client checks it: no step lost or applied twice). A reset makes a fresh environment per id
(an existing id is replaced: that is how a client replays). Errors are `{"error": "<one line>"}`: 400 a
malformed request (naming the field), 401 the token, 404 an unknown episode, 409 a step after the
episode ended, 413 a body over --max-body, 500 with `"env_error": true` the environment raised or
returned junk (or timed out). A request is validated whole before any environment is touched; the
server keeps serving after every error. Environments run one call at a time, in request order.

Once listening it writes {"host", "port", "pid"} to the ready file (atomically; --port 0: the OS picks).
An orphan exits: PR_SET_PDEATHSIG on Linux, and a thread that watches --parent-pid and getppid().
SIGTERM / SIGINT: a clean exit 0. A bad --env / --kwargs: one line on stderr, exit 2.

`Episodes` (table.py) is the table of live environments; LocalPool (table.py) uses it in process, so both
sides behave the same. wire.py's `jsonable` makes info dicts JSON-safe (non-JSON values are converted or
dropped); MAX_BATCH and MAX_ID are protocol limits (wire.py).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import faulthandler
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.env.base import EnvError
from gpufleet.env.runner import DEFAULT_TIMEOUT, TICK_S, EnvTimeout, Runner, Waiter, stderr
from gpufleet.env.table import EpisodeEnded, Episodes, UnknownEpisode
from gpufleet.env.wire import MAX_BATCH, MAX_ID, write_atomic

MAX_BODY = 8 * 1024 * 1024


class BadRequest(Exception):
    """A malformed request (400); the message names the field."""


def parse_batch(body: Any, kind: str) -> list[dict]:
    """The validated episodes of a /reset (id, seed) or /step (id, action) body; BadRequest if wrong."""
    value = "seed" if kind == "reset" else "action"
    if not isinstance(body, dict) or not {"episodes"} <= set(body) <= {"episodes", "timeout"}:
        raise BadRequest(f'the body must be {{"episodes": [{{"id": ..., "{value}": ...}}, ...]}}')
    items = body["episodes"]
    if not isinstance(items, list):
        raise BadRequest(f"episodes must be a list, got {type(items).__name__}")
    if len(items) > MAX_BATCH:
        raise BadRequest(
            f"episodes has {len(items)} items, over the limit of {MAX_BATCH}; send smaller batches"
        )
    seen: set[str] = set()
    for k, item in enumerate(items):
        at = f"episodes[{k}]"
        optional = {"options"} if kind == "reset" else set()  # Gymnasium's reset(seed=, options=)
        if not isinstance(item, dict) or not {"id", value} <= set(item) <= {"id", value} | optional:
            raise BadRequest(f'{at} must be {{"id": <str>, "{value}": ...}}, got {_short(item)}')
        if not isinstance(item.get("options", {}), dict):
            raise BadRequest(f"{at}.options must be an object, got {_short(item['options'])}")
        _check_id(item["id"], f"{at}.id", seen)
        if kind == "reset" and not _is_seed(item["seed"]):
            raise BadRequest(f"{at}.seed must be an integer in [-2**63, 2**64), got {_short(item['seed'])}")
        if kind == "step" and not isinstance(item["action"], str):
            raise BadRequest(f"{at}.action must be a string, got {_short(item['action'])}")
    return items


def parse_timeout(body: dict, default: float) -> float:
    """The body's "timeout" (seconds per environment call), or `default`; BadRequest if not > 0."""
    limit = body.get("timeout", default)
    if not isinstance(limit, int | float) or isinstance(limit, bool) or not 0 < limit < 1e9:
        raise BadRequest(f"timeout must be a number of seconds > 0, got {_short(limit)}")
    return float(limit)


def parse_ids(body: Any) -> list[str]:
    """The ids of a /close body; BadRequest if wrong."""
    ok = isinstance(body, dict) and {"ids"} <= set(body) <= {"ids", "timeout"}
    if not ok or not isinstance(body["ids"], list):
        raise BadRequest('the body must be {"ids": [<episode id>, ...]}')
    if len(body["ids"]) > MAX_BATCH:
        raise BadRequest(f"ids has {len(body['ids'])} items, over the limit of {MAX_BATCH}")
    for k, eid in enumerate(body["ids"]):
        _check_id(eid, f"ids[{k}]", None)
    return body["ids"]


def _check_id(eid: Any, at: str, seen: set[str] | None) -> None:
    if not isinstance(eid, str) or not eid or len(eid) > MAX_ID:
        raise BadRequest(f"{at} must be a non-empty string of at most {MAX_ID} characters, got {_short(eid)}")
    if seen is not None:
        if eid in seen:
            raise BadRequest(f"{at}: episode {eid!r} appears twice in one request")
        seen.add(eid)


def _is_seed(seed: Any) -> bool:
    return isinstance(seed, int) and not isinstance(seed, bool) and -(2**63) <= seed < 2**64


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)  # it came as JSON: quote it as JSON
    return text if len(text) <= 60 else text[:57] + "..."


def make_app(table: Episodes, token: str, max_body: int = MAX_BODY, timeout: float = DEFAULT_TIMEOUT):
    """The aiohttp application serving `table` (aiohttp is imported here, not at module level); its
    environments run on `runner` (app["runner"])."""
    from aiohttp import web

    runner = Runner(table)

    async def health(request: web.Request) -> web.Response:
        reply = {"ok": True, "env": table.name, "episodes": len(table), "pid": os.getpid()}
        return web.json_response(reply | {"busy": runner.busy()})

    async def reset(request: web.Request) -> web.Response:
        body = await _body(request)
        items = parse_batch(body, "reset")

        def job() -> list[dict]:
            results = []
            for item in items:
                obs, info = table.reset(item["id"], item["seed"], item.get("options"))
                results.append({"id": item["id"], "observation": obs, "info": info})
            return results

        return web.json_response({"results": await _run(runner, job, parse_timeout(body, timeout))})

    async def step(request: web.Request) -> web.Response:
        body = await _body(request)
        items = parse_batch(body, "step")
        limit = parse_timeout(body, timeout)

        def job() -> list[dict]:
            table.check_steppable([item["id"] for item in items])  # on the runner's thread: in order
            results = []
            for item in items:
                obs, reward, terminated, truncated, info, steps = table.step(item["id"], item["action"])
                results.append(
                    {"id": item["id"], "observation": obs, "reward": reward, "terminated": terminated}
                    | {"truncated": truncated, "info": info, "steps": steps}
                )
            return results

        return web.json_response({"results": await _run(runner, job, limit)})

    async def close(request: web.Request) -> web.Response:
        body = await _body(request)
        ids, limit = parse_ids(body), parse_timeout(body, timeout)
        return web.json_response({"closed": await _run(runner, lambda: table.close(ids), limit)})

    app = web.Application(client_max_size=max_body, middlewares=[_guard(token, max_body)])
    app.add_routes([web.get("/health", health), web.post("/reset", reset), web.post("/step", step)])
    app.add_routes([web.post("/close", close)])
    app["runner"] = runner
    return app


async def _run(runner: Runner, job: Callable[[], Any], limit: float) -> Any:
    """`job` on the runner's thread; heartbeats to the log while a call is slow; EnvTimeout past `limit`."""
    future, waiter = runner.submit(job, limit), Waiter(runner, stderr)
    wrapped = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({wrapped}, timeout=TICK_S)
        if done:
            return wrapped.result()
        try:
            waiter.tick(future)
        except EnvTimeout:
            wrapped.cancel()  # a late result of the stuck call goes nowhere
            raise


def _guard(token: str, max_body: int):
    """The middleware: the token first, then every error as {"error": <one line>} with its status."""
    from aiohttp import web

    expected = f"Bearer {token}".encode()

    def error(status: int, message: str, **extra: Any) -> web.Response:
        return web.json_response({"error": message.replace("\n", " "), **extra}, status=status)

    @web.middleware
    async def guard(request: web.Request, handler: Callable) -> web.StreamResponse:
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            what = "a wrong token" if "Authorization" in request.headers else "no Authorization header"
            return error(
                401, f"{what}: send 'Authorization: Bearer <token>' with the run's token file's text"
            )
        try:
            return await handler(request)
        except BadRequest as e:
            return error(400, str(e))
        except (UnknownEpisode, EpisodeEnded) as e:
            return error(e.status, str(e))
        except EnvTimeout as e:
            return error(500, str(e), env_error=True, timeout=e.wire)
        except EnvError as e:
            return error(500, str(e), env_error=True)
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"the request body is over {max_body} bytes (--max-body): send smaller batches")
        except web.HTTPException as e:
            return error(e.status, f"{request.method} {request.path}: {e.reason}")
        except Exception as e:
            traceback.print_exc()
            return error(500, f"internal error in the env server: {type(e).__name__}: {e}")

    return guard


async def _body(request: Any) -> Any:
    try:
        return json.loads(await request.read())
    except ValueError as e:
        raise BadRequest(f"the body is not JSON ({e})") from None


async def serve(table: Episodes, token: str, args: argparse.Namespace) -> bool:
    """Listen, write the ready file, serve until SIGTERM / SIGINT; whether an environment call is stuck."""
    from aiohttp import web

    app = make_app(table, token, args.max_body, args.timeout)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((args.host, args.port), family=family)
    await web.SockSite(runner, sock).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    port = sock.getsockname()[1]
    write_atomic(Path(args.ready_file), {"host": args.host, "port": port, "pid": os.getpid()})
    print(f"env server: {table.name} on {args.host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    await stop.wait()
    await runner.cleanup()
    return app["runner"].stuck()


def orphan_safety(parent_pid: int | None) -> None:
    """Exit when the parent dies: PR_SET_PDEATHSIG (Linux), and a thread watching the parent."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    ppid = os.getppid()

    def watch() -> None:
        while os.getppid() == ppid and (parent_pid is None or _alive(parent_pid)):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # the clean way out; forced if the loop does not answer
        time.sleep(10)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, someone else's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m gpufleet.env.server", description=__doc__.split("\n")[0])
    ap.add_argument("--env", required=True, help="env.name: builtin:keys, gymnasium:<id>, module:Class")
    ap.add_argument("--kwargs", default="{}", help="env.kwargs as a JSON object")
    ap.add_argument("--folder", action="append", default=[], help="where module:Class is looked for")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: the OS picks (see the ready file)")
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--max-body", type=int, default=MAX_BODY, help="largest request body in bytes")
    ap.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds an env call may take (unless a request says)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from gpufleet.env import source
    from gpufleet.errors import EXIT_USER_ERROR, UserError

    args = _args(argv)
    orphan_safety(args.parent_pid)
    try:
        kwargs, token = _kwargs(args.kwargs), _token(args.token_file)
        table = Episodes(source.factory(args.env, kwargs, args.folder), args.env)
        faulthandler.dump_traceback_later(args.timeout)  # a constructor stuck past it: its stack, in the log
        table.warm()
        faulthandler.cancel_dump_traceback_later()
    except (ValueError, UserError, EnvError) as e:
        fix = " Fix: check env.kwargs and the environment's constructor" if isinstance(e, EnvError) else ""
        print(f"env server: {e}{fix}".replace("\n", " "), file=sys.stderr)
        return EXIT_USER_ERROR
    stuck = False
    try:
        stuck = asyncio.run(serve(table, token, args))
    except KeyboardInterrupt:
        pass
    except OSError as e:  # cannot listen: the port is taken, the host is not this machine's
        print(f"env server: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if not stuck:  # an environment stuck in a call is left alone (its thread ends with the process)
        table.close_all()
    return 0


def _kwargs(text: str) -> dict:
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--kwargs {text!r} is not JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--kwargs {text!r} is not a JSON object")
    return kwargs


def _token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"cannot read --token-file {path}: {e.strerror or e}") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


if __name__ == "__main__":
    sys.exit(main())
