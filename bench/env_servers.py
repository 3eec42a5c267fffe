"""Throughput and latency of the environment servers through EnvPool, and a loss/duplication check.

    .venv/bin/python bench/env_servers.py [--servers 2] [--clients 1,4,16,64] [--steps 100] [--batch 1,8]
        [--kill]

Starts `--servers` servers of builtin:keys (gpufleet's manager, env/servers.py) with one door per step,
so every episode lasts exactly `--steps` steps when the right letter is typed. For each batch size B and
each N in --clients, N threads (one EnvPool each, as N trainer ranks would) reset B episodes and make
--steps step calls of B actions each (the right letter, read from the observation). Prints per row:
steps/s (environment steps: N * B * steps / wall time), p50 / p99 latency of one step call, and

    lost        a step that did not reach the environment (a call that raised, or the server's echoed
                step count behind the pool's)
    duplicated  a step applied twice (the server's echoed count ahead of the pool's)
    wrong       a result that differs from the same episode played in process (LocalPool)

all three must be 0 (exit 1 otherwise). --kill: in every row, server 0 is killed (SIGKILL) when client 0 is
half-way; the manager restarts it and the pools replay their episodes (the row's time includes that). Timings are for scale, not assertions; the client threads share
the machine's cores with the servers.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpufleet.env.client import EnvPool, LocalPool  # noqa: E402
from gpufleet.env.servers import EnvServers  # noqa: E402
from gpufleet.env.source import factory  # noqa: E402

ENV = "builtin:keys"


def action(observation: str) -> str:
    """The right answer to a door: its letter (the observation is '<letter>:', maybe after a newline)."""
    text = observation.strip()
    return text[0] * 4 if text else "a"


def client(servers_json: Path, who: int, batch: int, steps: int, out: dict, half: threading.Event) -> None:
    """One client thread: reset `batch` episodes, make `steps` step calls; record latencies and results."""
    pool = EnvPool.from_file(servers_json, timeout=60.0, retry_for=60.0)
    ids = [f"c{who}e{j}" for j in range(batch)]
    seeds = [who * 1000 + j for j in range(batch)]
    first = pool.reset(list(zip(ids, seeds, strict=True)))
    observations = [obs for obs, _ in first]
    latencies, results, lost = [], [first], 0
    for k in range(steps):
        if who == 0 and k == steps // 2:
            half.set()
        t0 = time.perf_counter()
        try:
            got = pool.step([(eid, action(obs)) for eid, obs in zip(ids, observations, strict=True)])
        except Exception as e:  # counted, and shown once
            out.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
            lost += len(ids)
            break
        latencies.append(time.perf_counter() - t0)
        results.append(got)
        observations = [r[0] for r in got]
    pool.close(ids)
    pool.shutdown()
    out[who] = {"latencies": latencies, "results": results, "seeds": seeds, "lost": lost, "stats": pool.stats}


def wrong_results(record: dict, steps: int) -> int:
    """Results that differ from the same episodes played in process."""
    local = LocalPool(factory(ENV, {"doors": steps}), ENV)
    ids = [f"e{j}" for j in range(len(record["seeds"]))]
    expected = [local.reset(list(zip(ids, record["seeds"], strict=True)))]
    for _ in range(len(record["results"]) - 1):
        observations = [r[0] for r in expected[-1]]
        expected.append(local.step([(eid, action(obs)) for eid, obs in zip(ids, observations, strict=True)]))
    return sum(
        a != b
        for got, want in zip(record["results"], expected, strict=True)
        for a, b in zip(got, want, strict=True)
    )


def run(servers: EnvServers, clients: int, batch: int, steps: int, kill: bool) -> dict:
    out: dict = {}
    half = threading.Event()
    args = [(servers.servers_json, who, batch, steps, out, half) for who in range(clients)]
    threads = [threading.Thread(target=client, args=a) for a in args]
    if kill:
        threads.append(
            threading.Thread(target=lambda: half.wait() and os.kill(servers.pids()[0], signal.SIGKILL))
        )
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    records = [out[who] for who in range(clients) if who in out]
    latencies = sorted(x for r in records for x in r["latencies"])
    done = sum(len(r["latencies"]) for r in records) * batch
    return {
        "steps_s": done / wall,
        "p50": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000
        if latencies
        else float("nan"),
        "lost": sum(r["lost"] + r["stats"]["lost"] for r in records)
        + (clients - len(records)) * batch * steps,
        "duplicated": sum(r["stats"]["duplicated"] for r in records),
        "wrong": sum(wrong_results(r, steps) for r in records),
        "replays": sum(r["stats"]["replays"] for r in records),
        "errors": out.get("errors", []),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--clients", default="1,4,16,64", help="comma-separated numbers of client threads")
    ap.add_argument("--steps", type=int, default=100, help="step calls per client (= doors per episode)")
    ap.add_argument("--batch", default="1,8", help="comma-separated episodes per step call")
    ap.add_argument("--kill", action="store_true", help="SIGKILL server 0 half-way through every row")
    args = ap.parse_args()
    clients = [int(x) for x in args.clients.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    bad = replays = 0
    with tempfile.TemporaryDirectory(prefix="bench-env-") as tmp:
        with EnvServers(ENV, {"doors": args.steps}, [], args.servers, Path(tmp)) as servers:
            servers.start()
            print(
                f"{args.servers} servers of {ENV} ({', '.join(servers.addresses())}), {args.steps} steps per client"
            )
            print(
                f"{'batch':>5} {'clients':>7} {'steps/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'lost':>5} {'dup':>5} {'wrong':>5}"
            )
            for batch in batches:
                for n in clients:
                    r = run(servers, n, batch, args.steps, args.kill)
                    print(
                        f"{batch:5d} {n:7d} {r['steps_s']:9.0f} {r['p50']:8.2f} {r['p99']:8.2f} "
                        f"{r['lost']:5d} {r['duplicated']:5d} {r['wrong']:5d}",
                        flush=True,
                    )
                    for line in r["errors"][:1]:
                        print(f"      first error: {line}")
                    bad += r["lost"] + r["duplicated"] + r["wrong"]
                    replays += r["replays"]
            restarts = servers.restarts
    print(f"server restarts: {restarts}; replays: {replays}; lost + duplicated + wrong = {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
