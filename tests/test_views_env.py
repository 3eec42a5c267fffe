"""Agent runs in the views: the device sampler records each environment server's CPU% and memory apart
from the ranks' (real servers under this process), and `watch` / `report` of a real agent run show the
env/* metrics and the servers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.env.client import EnvPool
from gpufleet.env.servers import EnvServers
from gpufleet.monitor.devices import DeviceSampler, devices_file
from helpers import console_script, process_env, run_user

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2


def test_sampler_records_env_servers_apart_from_the_ranks(tmp_path):
    with EnvServers("builtin:keys", {"doors": 6}, [], 2, tmp_path) as servers:
        servers.start()
        pool = EnvPool.from_file(servers.servers_json)
        with DeviceSampler(
            devices_file(tmp_path, 0), 0.05, {0: ("policy", None)}, in_process=True, nvml=False
        ):
            ids = [f"e{i}" for i in range(64)]
            for _ in range(20):  # keep the servers busy while the sampler runs
                pool.reset([(eid, i) for i, eid in enumerate(ids)])
                pool.close(ids)
            time.sleep(0.3)
        pids = servers.pids()
    records = [json.loads(x) for x in (tmp_path / "devices.jsonl").read_text().splitlines()]
    with_servers = [r for r in records if "env_servers" in r]
    assert len(with_servers) >= 3, records[-1]
    last = with_servers[-1]["env_servers"]
    assert [(s["index"], s["pid"]) for s in last] == [(0, pids[0]), (1, pids[1])]
    assert all(s["rss"] > 10 * MiB for s in last), last
    assert max(s["cpu_percent"] for r in with_servers for s in r["env_servers"]) > 0  # they did work
    assert all(r["ranks"][0]["pids"] == [os.getpid()] for r in records[:-1])  # never counted in the rank
    assert records[-1]["ranks"][0]["pids"] == []  # the sampler's last record: the run is over


@pytest.mark.slow
def test_watch_and_report_of_an_agent_run_show_the_environment(tmp_path):
    run = tmp_path / "agent"
    argv = [console_script(), "train", str(ROOT / "examples" / "agent-keys.yaml"), "--gpus", "cpu"]
    for s in (
        "train.max_steps=4",
        "train.per_device_batch=32",
        "monitor.device_interval=0.2",
        f"output.dir={run}",
    ):
        argv += ["--set", s]
    p = subprocess.run(argv, capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    w = run_user("watch", str(run), "--once", cwd=tmp_path)
    assert w.returncode == 0, w.stderr
    for key in ("env/turns_mean", "env/invalid_action_rate", "env/observation_cut_rate"):
        assert re.search(rf" {re.escape(key)} +│ +[\d.]+ │ \S+ +│ [\d.]+ \.\. [\d.]+", w.stdout), w.stdout
    assert re.search(r" env server 0 +│ .* +\d+% cpu │ 0\.0[1-9] GiB rss", w.stdout), w.stdout
    r = run_user("report", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (run / "report" / "index.html").read_text()
    assert ">Environment</h2>" in page and 'id="fig-environment"' in page
    assert "<h2 id='env-servers'>Environment servers</h2>" in page and "<td>env server 0</td>" in page


@pytest.mark.slow
def test_watch_and_report_of_a_trl_env_run_show_the_tools_not_a_success_rate_never_said(tmp_path):
    """A TRL environment class run (its tools called in chat episodes): watch and report show tools/* beside
    env/*, and leave out env/success_rate, which such a class never says (NaN on every step)."""
    run = tmp_path / "vault"
    sets = ["output.dir=vault", "train.max_steps=2", "train.per_device_batch=32", "train.log_every=1"]
    argv = ["train", str(ROOT / "examples" / "agent-vault-trl.yaml")]
    p = run_user(*argv, *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/success_rate"] != r["env/success_rate"] for r in rows if "step" in r)  # NaN
    w = run_user("watch", str(run), "--once", cwd=tmp_path)
    assert w.returncode == 0, w.stderr
    for key in ("tools/call_frequency", "tools/failure_frequency", "env/turns_mean"):
        assert re.search(rf" {re.escape(key)} +│ +[\d.]+ │", w.stdout), w.stdout
    assert "env/success_rate" not in w.stdout and "nan" not in w.stdout.lower(), w.stdout
    r = run_user("report", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'id="fig-environment"' in (run / "report" / "index.html").read_text()
