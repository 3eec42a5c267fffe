"""Imbalance and waste warnings from recorded numbers (monitor/advice.py), and the advisor saying each
kind once, on the console and in warnings.jsonl."""

from __future__ import annotations

import json

from gpufleet.monitor import advice
from gpufleet.monitor.advisor import EVERY, Advisor


def gpu_record(t: float, utils: list[int], roles: list[str]) -> dict:
    """A devices.jsonl record: GPU i holds rank i with roles[i] at utils[i]%."""
    return {
        "t": t,
        "gpus": [{"index": i, "util": u, "ranks": [i]} for i, u in enumerate(utils)],
        "ranks": [
            {"rank": i, "role": r, "pids": [100 + i], "cpu_percent": 100.0} for i, r in enumerate(roles)
        ],
    }


NOTE_001 = ["policy", "policy", "scorer: reference"]


def test_note_001_policy_imbalance_is_named():
    records = [gpu_record(t, [88 + t % 5, 28 + t % 5, 50], NOTE_001) for t in range(10)]  # 90 / 30 / 50
    found = advice.device_balance(records)
    assert [a.kind for a in found] == ["devices"]
    assert found[0].text.startswith("GPU 1 (policy) is busy 30% but GPU 0 (policy) 90%: the policy ranks do")


def test_an_idle_scorer_device_is_told_to_colocate():
    found = advice.device_balance([gpu_record(0, [85, 85, 20], NOTE_001)])
    assert found[0].text.startswith(
        "GPU 2 (scorer: reference) is busy 20% while the policy devices average 85%: colocate the reference"
    )


def test_a_saturated_scorer_is_the_bottleneck():
    found = advice.device_balance([gpu_record(0, [40, 40, 97], NOTE_001)], score_share=0.42)
    assert "policy devices are busy 40% waiting on GPU 2 (scorer: reference) at 97%" in found[0].text
    assert "timing/score is 42% of the step" in found[0].text


def test_balanced_devices_say_nothing_and_cpu_ranks_use_cpu_percent():
    assert advice.device_balance([gpu_record(0, [80, 70, 60], NOTE_001)]) == []
    cpu = {"t": 0, "gpus": [], "ranks": [
        {"rank": 0, "role": "policy", "pids": [1], "cpu_percent": 180.0},  # 2 cores: counted as 100%
        {"rank": 1, "role": "policy", "pids": [2], "cpu_percent": 20.0},
        {"rank": 2, "role": "policy", "pids": [], "cpu_percent": 0.0},  # not started: left out
    ]}  # fmt: skip
    found = advice.device_balance([cpu])
    assert found[0].text.startswith("rank 1 (policy) is busy 20% but rank 0 (policy) 100%")


def steps(comm0: float, comm1: float, n: int = 4) -> list[dict]:
    m = {
        "step_time/rank0": 2.0, "step_time/rank1": 2.0,
        "timing/comm/rank0": comm0, "timing/comm/rank1": comm1,
        "timing/generate/rank0": 0.5, "timing/generate/rank1": 1.5 - comm1,
        "timing/score/rank0": 1.5 - comm0, "timing/score/rank1": 0.5,
        "timing/other/rank0": 0.0, "timing/other/rank1": 0.0,
    }  # fmt: skip
    return [m] * n


def test_a_rank_waiting_for_another_names_the_slow_rank_and_its_phase():
    found = advice.rank_balance(steps(comm0=0.1, comm1=1.0))
    assert found[0].text.startswith(
        "rank 1 waits 50% of its step in collectives for rank 0 (waits 5%), whose slowest phase is score "
        "(1.40 s/step)"
    )
    assert advice.rank_balance(steps(comm0=0.3, comm1=0.4)) == []  # both wait a little: balanced
    assert advice.rank_balance([{"timing/comm": 0.0}]) == []  # one rank


def test_memory_against_the_plan():
    low = advice.memory_vs_plan(0.3, 6.0, 20.0, batch=8, largest=24)
    assert low[0].text == (
        "peak memory 6.00 GiB is 30% of the plan's 20.00 GiB: room for a larger batch or longer completions; "
        "gpufleet plan says train.per_device_batch up to 24 fits (now 8)"
    )
    high = advice.memory_vs_plan(1.25, 25.0, 20.0, batch=8, largest=8)
    assert "is 125% of the plan's 20.00 GiB: above the prediction" in high[0].text
    assert (
        advice.memory_vs_plan(0.9, 18.0, 20.0, 8, 24) == []
        and advice.memory_vs_plan(None, 1, None, 8, 8) == []
        # a tiny job: 1.03 GiB planned of which 1 GiB is the per-process overhead (seen on an H200 with
        # the quickstart: 0.08 GiB measured, "room for per_device_batch up to 642870"): nothing to say
        and advice.memory_vs_plan(0.08, 0.08, 1.03, 128, 642870, overhead_gib=1.0) == []
        and advice.memory_vs_plan(0.3, 6.0, 20.0, 8, 24, overhead_gib=1.0) != []
    )


def test_the_advisor_says_each_kind_once(tmp_path):
    lines = []
    (tmp_path / "plan.json").write_text(json.dumps({"largest_per_device_batch": 32}))
    a = Advisor(tmp_path, batch=8, on_gpu=True, log=lines.append)
    m = {"step_time": 1.0, "memory/plan_ratio": 0.2, "memory/peak_gib": 1.0, "memory/plan_gib": 5.0}
    said = [a.observe({**m, "step": i + 1}) for i in range(3 * EVERY)]
    assert [len(x) for x in said].count(1) == 1 and len(said[EVERY - 1]) == 1  # once, at the first look
    assert lines == [f"warning: {said[EVERY - 1][0].text}"] and "up to 32 fits (now 8)" in lines[0]
    records = [json.loads(x) for x in (tmp_path / "warnings.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in records] == [(EVERY, "memory")]


def test_plan_record_keeps_each_ranks_overhead():
    """OUTPUT/plan.json carries each rank's fixed overhead, which the memory advice leaves out."""
    from pathlib import Path

    from gpufleet.config.load import load_job
    from gpufleet.hardware import GiB, parse_gpu_spec
    from gpufleet.monitor.memory import plan_record
    from gpufleet.plan.search import make_plan

    job = Path(__file__).resolve().parents[1] / "examples" / "gspo-3gpu.yaml"
    plan, _ = make_plan(load_job(job, [], env={}), parse_gpu_spec("3x16GB"), {}, choose=False)
    ranks = plan_record(plan)["ranks"]
    assert [r["role"] for r in ranks] == ["policy rank 0", "policy rank 1", "scorer: reference"]
    assert all(r["overhead_bytes"] == 1 * GiB < r["bytes"] for r in ranks)
