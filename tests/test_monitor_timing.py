"""Phase timings and peak memory vs plan: the clock against a fake time source (hand-computed), the
metric builders on recorded numbers, and real `gpufleet train` runs on 1 and 2 gloo processes whose
`timing/*` add up to `step_time` on every rank."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gpufleet.monitor import timing
from gpufleet.monitor.memory import memory_metrics
from gpufleet.monitor.timing import PHASES, PhaseClock, step_timings
from helpers import console_script, process_env

ROOT = Path(__file__).resolve().parents[1]


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nested_phases_are_exclusive_and_add_up(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    clock = PhaseClock()
    clock.start_step()
    fake.now += 0.5  # other
    with clock.phase("generate"):
        fake.now += 2.0
        with clock.phase("score"):
            fake.now += 1.0
            with clock.phase("comm"):
                fake.now += 0.25
        fake.now += 1.0
    with clock.phase("backward"):
        fake.now += 3.0
    with clock.phase("comm"):
        fake.now += 0.75
    fake.now += 0.5  # other
    s = clock.end_step()
    assert s == {
        "generate": 3.0,
        "score": 1.0,
        "env": 0.0,
        "tools": 0.0,
        "backward": 3.0,
        "optimizer": 0.0,
        "comm": 1.0,
        "checkpoint": 0.0,
        "other": 1.0,
    }
    assert sum(s.values()) == fake.now - 100.0
    clock.start_step()  # a new step starts from zero
    fake.now += 1.0
    assert clock.end_step()["other"] == 1.0


def test_a_phase_left_by_an_exception_is_closed(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    clock = PhaseClock()
    with pytest.raises(RuntimeError), clock.phase("generate"):
        fake.now += 2.0
        raise RuntimeError
    fake.now += 1.0
    s = clock.end_step()
    assert (s["generate"], s["other"]) == (2.0, 1.0)
    with pytest.raises(ValueError, match="unknown phase 'gen'"), clock.phase("gen"):
        pass


def test_step_timings_rank0_max_and_per_rank():
    r0 = [1.0, 0.5, 0.0, 0.0, 2.0, 0.1, 0.3, 0.0, 0.1]  # PHASES order: env, then tools, are 0 here
    r1 = [1.5, 0.2, 0.0, 0.0, 1.0, 0.1, 1.1, 0.0, 0.2]
    m = step_timings([r0, r1], [4.0, 4.1])
    assert m["timing/generate"] == 1.0 and m["timing/generate/max"] == 1.5
    assert m["timing/comm/rank1"] == 1.1 and m["timing/backward/rank0"] == 2.0
    assert m["step_time/max"] == 4.1 and m["step_time/rank1"] == 4.1
    one = step_timings([r0], [4.0])
    assert not any("/rank" in k for k in one)
    assert sum(one[f"timing/{p}"] for p in PHASES) == pytest.approx(4.0)


def test_memory_metrics_ratio_against_the_plan():
    gib = 1024**3
    m = memory_metrics([(1.5 * gib, 2 * gib), (3 * gib, 2 * gib)])
    assert m["memory/peak_gib"] == 1.5 and m["memory/peak_gib/max"] == 3.0
    assert m["memory/plan_gib"] == 2.0 and m["memory/plan_ratio"] == 0.75
    assert m["memory/plan_ratio/max"] == 1.5 and m["memory/plan_ratio/rank1"] == 1.5
    no_plan = memory_metrics([(gib, 0)])
    assert no_plan == {"memory/peak_gib": 1.0, "memory/peak_gib/max": 1.0}


def _train(tmp_path: Path, *sets: str, ranks: int = 1) -> list[dict]:
    """A real `gpufleet train` from a folder outside the repo; its metrics; devices.jsonl checked."""
    run = tmp_path / "run"
    argv = [console_script(), "train", str(ROOT / "examples" / "quickstart.yaml"), "--gpus", "cpu"]
    common = (
        "train.max_steps=3",
        "train.per_device_batch=8",
        "output.save_every=2",
        "monitor.device_interval=0.2",
    )
    for s in (*common, *sets):
        argv += ["--set", s]
    argv += ["--set", f"output.dir={run}"]
    p = subprocess.run(argv, capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    plan = json.loads((run / "plan.json").read_text())
    assert [r["role"] for r in plan["ranks"]] == [f"policy rank {i}" for i in range(ranks)]
    devices = [json.loads(line) for line in (run / "devices.jsonl").read_text().splitlines()]
    assert all([r["role"] for r in d["ranks"]] == ["policy"] * ranks for d in devices)
    assert any(all(r["pids"] and r["rss"] > 100 * 1024**2 for r in d["ranks"]) for d in devices)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _phase_sum(m: dict, suffix: str = "") -> float:
    return sum(m[f"timing/{p}{suffix}"] for p in PHASES)


def test_one_process_timings_add_up_to_step_time(tmp_path):
    records = _train(tmp_path)
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        assert _phase_sum(m) == pytest.approx(m["step_time"], rel=0.03)
        assert m["timing/generate"] > 0 and m["timing/backward"] > 0 and m["timing/optimizer"] > 0
        assert m["timing/comm"] == 0.0  # one process: no collective
        assert m["memory/peak_gib"] > 0.05 and 0.05 < m["memory/plan_ratio"] < 5
    assert [m["timing/checkpoint"] > 0 for m in records] == [False, True, True]  # save_every=2, last


@pytest.mark.slow
def test_two_processes_timings_per_rank_and_a_slow_rank_named(tmp_path):
    """2 gloo ranks: every rank's phases add up to its step time; rank 1's reward function is slow, so
    rank 0 waits for it in collectives, and the run says so in a warning."""
    records = _train(
        tmp_path,
        "launch.nproc_per_node=2",
        "train.per_device_batch=4",
        "train.max_steps=10",
        "output.save_every=0",
        "reward.functions=mp_rewards:slow_on_rank1",
        "reward.weights=null",
        ranks=2,
    )
    for m in records:
        assert _phase_sum(m) == pytest.approx(m["step_time"], rel=0.03)
        assert m["step_time/rank0"] == m["step_time"]
        for r in (0, 1):
            assert _phase_sum(m, f"/rank{r}") == pytest.approx(m[f"step_time/rank{r}"], rel=0.03)
            assert m[f"timing/comm/rank{r}"] > 0  # rewards are gathered, losses reduced
            assert m[f"memory/plan_ratio/rank{r}"] > 0
        assert m["timing/score/max"] == m["timing/score/rank1"] > m["timing/score/rank0"]
    said = [json.loads(x) for x in (tmp_path / "run" / "warnings.jsonl").read_text().splitlines()]
    ranks = [w for w in said if w["kind"] == "ranks"]
    assert ranks and ranks[0]["step"] == 10, said
    assert "rank 0 waits" in ranks[0]["text"] and "for rank 1" in ranks[0]["text"], ranks
    assert "whose slowest phase is score" in ranks[0]["text"], ranks
    assert ranks[0]["text"] in (tmp_path / "run" / "logs" / "rank0.log").read_text()
