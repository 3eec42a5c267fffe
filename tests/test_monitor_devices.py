"""The device sampler: the NVML path against the recorded fake NVML (tests/fake_nvml.py), the CPU path
on real child processes carrying torchrun's RANK variable, and devices.jsonl written beside a real
`gpufleet launch` of a script on 2 processes (the `gpufleet train` runs are in test_monitor_timing.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import fake_nvml
from gpufleet.monitor.devices import DeviceSampler, devices_file
from gpufleet.monitor.runfiles import HOST, ended, read_jsonl
from helpers import run_user

MiB = fake_nvml.MiB


def test_nvml_sample_per_gpu_with_the_ranks_on_it(tmp_path):
    me = os.getpid()
    nvml = fake_nvml.workstation(busy={1: [(me, 3000 * MiB), (4242, 1000 * MiB)]})
    nvml.gpus[0].util, nvml.gpus[0].power_mw, nvml.gpus[0].temp_c = (90, 40), 351500, 71
    nvml.gpus[1].util = (30, 5)
    nvml.fail.add(("power", 2))
    labels = {0: ("policy", 0), 1: ("policy", 1), 2: ("scorer: reference", None)}
    s = DeviceSampler(tmp_path / "d.jsonl", 1.0, labels, nvml=nvml, env={"CUDA_VISIBLE_DEVICES": "1,0,2"})
    s._open_nvml()
    s.ranks.known[me] = (s.ranks.root, 2)  # this process plays rank 2 (found by its pid on GPU 1)
    s.ranks.in_process = False
    rec = s.sample()
    g0, g1, g2 = rec["gpus"]
    assert g0 == {  # CUDA device 0 is physical GPU 1 here
        "index": 0,
        "name": "NVIDIA GeForce RTX 4090",
        "util": 30,
        "mem_util": 5,
        "mem_used": (430 + 3000 + 1000) * MiB,
        "mem_total": fake_nvml.RTX4090,
        "power_w": 21.0,
        "temp_c": 34,
        "ranks": [0],
    }
    assert (g1["util"], g1["mem_util"], g1["power_w"], g1["temp_c"]) == (90, 40, 351.5, 71)
    assert g1["ranks"] == [1] and g1["mem_used"] == 430 * MiB
    assert g2["power_w"] is None and g2["name"] == "NVIDIA RTX A6000"  # NVML did not answer: unknown
    assert [r["role"] for r in rec["ranks"]] == ["policy", "policy", "scorer: reference"]


def test_nvml_missing_or_failing_means_cpu_only(tmp_path):
    s = DeviceSampler(
        tmp_path / "d.jsonl", 1.0, {}, nvml=fake_nvml.workstation(init_fails=True), in_process=True
    )
    s._open_nvml()
    rec = s.sample()
    assert rec["gpus"] == [] and [r["rank"] for r in rec["ranks"]] == [0]
    assert rec["ranks"][0]["pids"] == [os.getpid()] and rec["ranks"][0]["rss"] > 10 * MiB


def test_an_in_process_run_says_it_is_over_when_its_sampler_stops(tmp_path):
    """A 1-process run samples its own process, alive in every sample: on stop the sampler writes a last
    record with no rank alive (as a launcher's sample after its ranks exit), so watch and report see
    that the run is over, from any machine."""
    with DeviceSampler(tmp_path / "d.jsonl", 0.05, {0: ("policy", None)}, nvml=False, in_process=True):
        time.sleep(0.2)
    records = read_jsonl(tmp_path / "d.jsonl")
    assert records[0]["ranks"][0]["pids"] == [os.getpid()] and records[-1]["host"] == HOST
    assert records[-1]["ranks"][0]["pids"] == [] and records[-1]["ranks"][0]["role"] == "policy"
    assert ended(records)
    assert not ended(records[:-1])  # the process named in the others still runs (it is this one)


CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    if os.environ["RANK"] == "0":  # rank 0 starts a helper of its own (a data loader would)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    data = bytearray(60 * 1024 * 1024 * (1 + int(os.environ["RANK"])))  # held: rank 1 holds more
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_cpu_ranks_are_process_trees_with_cpu_and_rss(tmp_path):
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD],
            env={**os.environ, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        for k in kids:
            assert k.stdout.readline().strip() == "ready"
        labels = {0: ("worker", None), 1: ("worker", None)}
        with DeviceSampler(devices_file(tmp_path, 0), 0.05, labels, nvml=False) as s:
            while len((tmp_path / "devices.jsonl").read_text().splitlines()) < 3:
                time.sleep(0.05)
            rec = s.sample()
    finally:
        for k in kids:
            k.kill()
            k.wait()
    r0, r1 = rec["ranks"]
    assert r0["pids"][0] == kids[0].pid and len(r0["pids"]) == 2  # rank 0 and its helper
    assert r1["pids"] == [kids[1].pid]
    assert r1["rss"] > 110 * MiB and r0["rss"] > 60 * MiB and r1["rss"] > r0["rss"] - 30 * MiB
    assert r0["cpu_percent"] >= 0 and rec["gpus"] == []
    records = [json.loads(x) for x in (tmp_path / "devices.jsonl").read_text().splitlines()]
    assert all([r["rank"] for r in x["ranks"]] == [0, 1] for x in records)
    assert records[-1]["t"] >= records[0]["t"]


SCRIPT = """
import os, time
data = bytearray(40 * 1024 * 1024)
time.sleep(2.5)
print("rank", os.environ["RANK"], "done", flush=True)
"""

JOB = """
script:
  command: python work.py
monitor:
  device_interval: 0.2
output:
  dir: run
"""


def test_launch_writes_devices_jsonl_for_each_rank(tmp_path):
    home = tmp_path / "me"
    home.mkdir()
    (home / "job.yaml").write_text(JOB)
    (home / "work.py").write_text(SCRIPT)
    p = run_user("launch", "job.yaml", "--gpus", "cpu", "--nproc", "2", cwd=home, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    records = [json.loads(x) for x in (home / "run" / "devices.jsonl").read_text().splitlines()]
    assert all(
        [(r["rank"], r["role"]) for r in x["ranks"]] == [(0, "worker"), (1, "worker")] for x in records
    )
    fullest = max(records, key=lambda x: sum(r["rss"] for r in x["ranks"]))  # the scripts hold 40 MiB
    assert all(r["rss"] > 40 * MiB and len(r["pids"]) >= 2 for r in fullest["ranks"])  # rankexec + script


def test_a_process_this_user_may_not_inspect_counts_as_running(monkeypatch):
    """psutil's AccessDenied (another user's process, /proc mounted hidepid): the process exists, so the
    rank is alive; a pid that is gone is not."""
    import os

    import psutil

    from gpufleet.monitor import runfiles

    record = {"t": 0.0}  # a record older than any live process: only the error decides
    assert not runfiles.still_running(record, [2**22 + 12345])  # no such pid

    def denied(pid):
        raise psutil.AccessDenied(pid)

    monkeypatch.setattr(runfiles.psutil, "Process", denied)
    assert runfiles.still_running(record, [os.getpid()])
