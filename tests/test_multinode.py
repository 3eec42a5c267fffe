"""Two node agents started by hand on one machine (c10d rendezvous on 127.0.0.1), as on two hosts:
they train together and give the weights of one node with two processes; a node that never arrives
makes the other stop with a clear line after launch.rendezvous_timeout, no hang."""

from __future__ import annotations

import subprocess

import pytest

from gpufleet.launch.torchrun import free_port
from test_multiprocess import BASE, QUICK, ROOT, assert_moved, assert_same_weights, train

pytestmark = pytest.mark.slow


def node(run, port: int, rank: int, *sets: str, timeout_s: int = 60) -> subprocess.Popen:
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])
    argv = [sys.executable, "-m", "gpufleet", "train", QUICK, *BASE, "--set", f"output.dir={run}"]
    for s in (
        "train.per_device_batch=8",
        "launch.nnodes=2",
        f"launch.node_rank={rank}",
        f"launch.rdzv_endpoint=127.0.0.1:{port}",
        f"launch.rendezvous_timeout={timeout_s}",
        *sets,
    ):
        argv += ["--set", s]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def test_two_nodes_equal_one_node_with_two_processes(tmp_path):
    one = tmp_path / "one-node"
    p = train(one, "train.per_device_batch=8", "launch.nproc_per_node=2")
    assert p.returncode == 0, p.stdout + p.stderr
    two = tmp_path / "two-nodes"
    port = free_port()
    nodes = [node(two, port, 0), node(two, port, 1)]
    outs = [n.communicate(timeout=300) for n in nodes]
    for n, (out, err) in zip(nodes, outs, strict=True):
        assert n.returncode == 0, out + err
    (out0, _), (out1, _) = outs
    assert "model:" in out0 and "final" in out0  # node 0 announces the model ...
    assert "model:" not in out1 and "node 0 writes the model" in out1  # ... node 1 does not
    assert sorted(x.name for x in (two / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert "node 1" in (two / "logs" / "rank1.log").read_text()
    assert_moved(two)
    assert_same_weights(one, two)
    # each node's sampler wrote its own devices file; watch shows both nodes' ranks (issue 11)
    assert (two / "devices.jsonl").exists() and (two / "devices.node1.jsonl").exists()
    from helpers import run_user

    p = run_user("watch", str(two), "--once", cwd=tmp_path, env_extra={"COLUMNS": "160"})
    assert p.returncode == 0 and "node0:rank0 policy" in p.stdout and "node1:rank1 policy" in p.stdout, (
        p.stdout
    )


def test_node_that_never_arrives_stops_the_other(tmp_path):
    run = tmp_path / "run"
    p = node(run, free_port(), 0, timeout_s=5)
    out, err = p.communicate(timeout=120)  # no hang: the rendezvous gives up after 5 s
    assert p.returncode == 2, out + err
    line = [x for x in err.splitlines() if x.startswith("gpufleet: error:")]
    assert len(line) == 1 and "waited 5 s at the rendezvous" in line[0] and "not all 2 nodes" in line[0]
    assert "launch.rendezvous_timeout" in line[0]
    assert "Traceback" not in out + err
    assert not (run / "final").exists()
