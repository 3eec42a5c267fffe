"""Monitoring a run over several nodes (issue 11): each node's sampler writes its own devices file
(devices.jsonl on node 0, devices.node<N>.jsonl on node N); the warnings, `gpufleet watch` and
`gpufleet report` read every node's, and name devices with their node (`node1:gpu1`). Recorded files
of 2 nodes x 2 GPUs (and of 2 CPU-only nodes), read by the installed commands from a user's folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpufleet.monitor import advice
from gpufleet.monitor.advisor import EVERY, Advisor
from gpufleet.monitor.runfiles import read_devices
from helpers import run_user

GiB = 1024**3
UTIL = {0: [92, 88], 1: [90, 25]}  # utilisation % per node and GPU: node 1 GPU 1 idles


def gpu_record(t: float, node: int) -> dict:
    """One sample of a node with 2 GPUs; GPU i holds global rank 2 * node + i (a policy rank)."""
    ranks = [2 * node, 2 * node + 1]
    return {
        "t": t,
        "node": node,
        "cpu_percent": 50.0,
        "gpus": [
            {
                "index": i,
                "name": "NVIDIA A100-SXM4-80GB",
                "util": UTIL[node][i],
                "mem_used": (20 + 10 * node + i) * GiB,
                "mem_total": 80 * GiB,
                "ranks": [r],
            }
            for i, r in enumerate(ranks)
        ],
        "ranks": [
            {"rank": r, "role": "policy", "device": i, "pids": [100 + r], "cpu_percent": 100.0, "rss": GiB}
            for i, r in enumerate(ranks)
        ],
    }


def cpu_record(t: float, node: int) -> dict:
    """One sample of a CPU-only node running global rank `node`."""
    return {
        "t": t,
        "node": node,
        "cpu_percent": 50.0,
        "gpus": [],
        "ranks": [
            {
                "rank": node,
                "role": "policy",
                "device": None,
                "pids": [100 + node],
                "cpu_percent": 95.0 - 50 * node,
                "rss": (1 + node) * GiB,
            }
        ],
    }


def write_run(folder: Path, record, t0: float, samples: int = 5) -> Path:
    """A finished 3-step run whose two nodes wrote their own devices files (shared OUTPUT)."""
    folder.mkdir(parents=True)
    metrics = [
        {"step": s, "step_time": 1.0, "reward": 0.1 * s, "kl": 0.01, "completions/mean_length": 9.0}
        for s in (1, 2, 3)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / "job.yaml").write_text("train:\n  max_steps: 3\n")
    for node, name in ((0, "devices.jsonl"), (1, "devices.node1.jsonl")):
        lines = [json.dumps(record(t0 + i + 0.1 * node, node)) for i in range(samples)]
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


def test_every_nodes_devices_are_read_and_labelled(tmp_path):
    run = write_run(tmp_path / "run", gpu_record, time.time())
    records = read_devices(run)
    assert [r["node"] for r in records] == [0, 1] * 5  # merged in time order
    found = advice.device_balance(records)
    assert len(found) == 1, found
    text = found[0].text
    assert text.startswith("node1:gpu1 (policy) is busy 25% but node0:gpu0 (policy) 92%"), text


def test_watch_once_shows_every_node(tmp_path):
    run = write_run(tmp_path / "run", gpu_record, time.time())
    p = run_user("watch", str(run), "--once", cwd=tmp_path, env_extra={"COLUMNS": "160"})
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.strip().startswith("node")}
    assert sorted(rows) == ["node0:gpu0", "node0:gpu1", "node1:gpu0", "node1:gpu1"], p.stdout
    assert (
        "policy 3" in rows["node1:gpu1"]
        and "25%" in rows["node1:gpu1"]
        and "31.0/80.0 GiB" in rows["node1:gpu1"]
    )
    assert "policy 0" in rows["node0:gpu0"] and "92%" in rows["node0:gpu0"]


def test_report_lists_every_node(tmp_path):
    run = write_run(tmp_path / "run", gpu_record, time.time())
    p = run_user("report", str(run), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    page = (run / "report" / "index.html").read_text()
    assert (run / "report" / "devices.png").exists() and ">Devices over time</h2>" in page
    devices = page.split("<h2 id='devices'>Devices</h2>")[1].split("<h2")[0]
    for label, busy, peak in (
        ("node0:gpu0 (policy 0)", 92, 20),
        ("node0:gpu1 (policy 1)", 88, 21),
        ("node1:gpu0 (policy 2)", 90, 30),
        ("node1:gpu1 (policy 3)", 25, 31),
    ):
        row = f'<td>{label}</td><td class="num">{busy}</td><td class="num">{peak}</td><td class="num">5</td>'
        assert row in devices, (row, devices)


def test_cpu_nodes_label_ranks_with_their_node(tmp_path):
    run = write_run(tmp_path / "run", cpu_record, time.time())
    p = run_user("watch", str(run), "--once", cwd=tmp_path, env_extra={"COLUMNS": "160"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "node0:rank0 policy" in p.stdout and "node1:rank1 policy" in p.stdout, p.stdout
    found = advice.device_balance(read_devices(run))
    assert found and "node1:rank1 (policy) is busy 45% but node0:rank0 (policy) 95%" in found[0].text


def test_the_advisor_reads_every_nodes_file(tmp_path):
    """Rank 0's advisor, during a run: node 1's samples (its own file in the shared OUTPUT) are in its look."""
    t0 = time.time()
    run = write_run(tmp_path / "run", gpu_record, t0, samples=EVERY + 2)
    said: list[str] = []
    adv = Advisor(run, batch=8, on_gpu=False, log=said.append)
    for step in range(1, EVERY + 1):
        adv.observe({"step": step, "step_time": 0.0})
    assert len(said) == 1 and "node1:gpu1 (policy) is busy 25%" in said[0], said
    written = [json.loads(x) for x in (run / "warnings.jsonl").read_text().splitlines()]
    assert [w["kind"] for w in written] == ["devices"]
