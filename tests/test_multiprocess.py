"""Real torchrun processes on CPU (gloo): results do not depend on the rank count, roles can live on
their own ranks, and a failing rank ends the whole run with that rank named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")
BASE = [
    "--gpus",
    "cpu",
    "--set",
    "train.max_steps=3",
    "--set",
    "train.learning_rate=1e-3",
    "--set",
    "reward.functions=repeat/chars,mp_rewards:length",
    "--set",
    "reward.weights=null",
    "--set",
    "output.save_every=0",
]


def train(run: Path, *sets: str, env_extra=None, timeout=240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])
    env.update(env_extra or {})
    argv = [sys.executable, "-m", "gpufleet", "train", QUICK, *BASE, "--set", f"output.dir={run}"]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(
        run / "final" / "model.safetensors"
    )  # the same keys whatever the strategy (tied head once)


def assert_same_weights(a: Path, b: Path, tol: float = 1e-5) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)
    assert worst <= tol, worst


def assert_moved(run: Path) -> None:
    from gpufleet.models.builtin import materialize

    initial = load_file(materialize("tiny-qwen2") / "model.safetensors")
    assert any(not torch.equal(initial[k], v) for k, v in weights(run).items())


_baselines: dict[tuple, Path] = {}


def baseline(tmp_path_factory, *sets: str) -> Path:
    if sets not in _baselines:
        run = tmp_path_factory.mktemp("one-rank") / "run"
        p = train(run, "train.per_device_batch=16", *sets)
        assert p.returncode == 0, p.stdout + p.stderr
        _baselines[sets] = run
    return _baselines[sets]


@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("ddp", ()),
        ("fsdp", ()),
        # (make test: ddp and fsdp; the off-policy variants run with the slow tests, as CI does)
        pytest.param(
            "ddp", ("algorithm.loss_type=dapo", "train.steps_per_generation=2"), marks=pytest.mark.slow
        ),
        # the newer loss types (issue 16), off-policy on every second step
        *[
            pytest.param(
                "ddp", (f"algorithm.name={n}", "train.steps_per_generation=2"), id=n, marks=pytest.mark.slow
            )
            for n in ("cispo", "sapo", "luspo", "vespo")
        ],
    ],
)
def test_two_ranks_equal_one_rank(tmp_path, tmp_path_factory, strategy, extra):
    one = baseline(tmp_path_factory, *extra)
    two = tmp_path / "two"
    p = train(
        two, "train.per_device_batch=8", "launch.nproc_per_node=2", f"placement.strategy={strategy}", *extra
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 policy ranks" in p.stdout
    assert sorted(x.name for x in (two / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert p.stdout.count("step 3/3") == 1  # only rank 0 prints progress
    assert_moved(one)
    assert_same_weights(one, two)


@pytest.mark.slow
def test_dedicated_scorer_equals_colocated(tmp_path):
    from mp_rewards import tiny_reward_model

    rm = tiny_reward_model(tmp_path / "rm")
    common = (
        "train.per_device_batch=8",
        "algorithm.beta=0.1",
        f"reward.model={rm}",
        "reward.weights=1,1,0.5",
        "placement.policy=0,1",
        "rollout.min_completion_length=4",  # the scorer drops EOS early, as the policy does
    )
    colocated, dedicated = tmp_path / "colocated", tmp_path / "dedicated"
    p = train(colocated, *common, "placement.reference=colocate", "placement.reward=colocate")
    assert p.returncode == 0, p.stdout + p.stderr
    p = train(dedicated, *common, "placement.reference=2", "placement.reward=2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reference+reward on scorer cpu process 2" in p.stdout
    scorer_log = (dedicated / "logs" / "rank2.log").read_text()
    assert "scorer rank 2 on cpu: reference, reward" in scorer_log
    assert_moved(colocated)
    assert_same_weights(colocated, dedicated)
    import json

    rows = [json.loads(x) for x in (dedicated / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kl"] > 0  # the reference model was really used
    # the scorer's work per round is in the metrics, within the step (issue 11: every rank's time)
    assert all(0 < r["timing/scorer/rank2"] < r["step_time"] for r in rows)


@pytest.mark.slow
def test_reference_sync_on_a_scorer_rank_equals_colocated_and_resumes(tmp_path):
    """TR-DPO reference sync every step: the scorer rank receives the mixed weights as a colocated
    reference mixes them; a run crashed after its step-2 checkpoint resumes to the same weights (the
    scorer's mixed reference is saved and sent back)."""
    common = (
        "train.per_device_batch=8",
        "train.max_steps=4",
        "algorithm.beta=0.1",
        "algorithm.sync_ref_model=true",
        "algorithm.ref_model_sync_steps=1",
        "algorithm.ref_model_mixup_alpha=0.5",
        "placement.policy=0,1",
    )
    colocated, dedicated = tmp_path / "colocated", tmp_path / "dedicated"
    p = train(colocated, *common, "placement.reference=colocate")
    assert p.returncode == 0, p.stdout + p.stderr
    crash = {"GPUFLEET_TEST_CRASH": "0:3"}  # rank 0 raises at the start of step 3, after checkpoint 2
    p = train(dedicated, *common, "placement.reference=2", "output.save_every=2", env_extra=crash)
    assert p.returncode != 0 and (dedicated / "checkpoints" / "step-2" / "reference.safetensors").is_file()
    p = train(dedicated, *common, "placement.reference=2", "output.save_every=2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from" in p.stdout
    assert_moved(colocated)
    assert_same_weights(colocated, dedicated)


def test_failing_rank_stops_everything(tmp_path):
    run = tmp_path / "run"
    # A hang would end in the 90 s timeout (collectives wait 600 s by default): the run must end by itself.
    p = train(
        run,
        "train.per_device_batch=8",
        "launch.nproc_per_node=2",
        "train.max_steps=6",
        env_extra={"GPUFLEET_TEST_CRASH": "1:2"},
        timeout=90,
    )
    assert p.returncode == 1
    assert "rank 1 failed: RuntimeError: injected crash on rank 1 at step 2" in p.stderr
    assert "last lines of" in p.stderr and "rank1.log" in p.stderr
    assert not (run / "final").exists()


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    """A rank that dies by a signal leaves no error record: the summary names the rank and the signal
    (torchrun's failure summary), not only "a worker died"."""
    run = tmp_path / "run"
    p = train(
        run,
        "train.per_device_batch=8",
        "launch.nproc_per_node=2",
        "reward.functions=repeat/chars,mp_rewards:abort_on_rank1",
        timeout=120,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "rank 1 was killed by SIGABRT (signal 6) without an error record" in p.stderr, p.stderr
    assert not (run / "final").exists()


def test_print_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    argv = [
        sys.executable,
        "-m",
        "gpufleet",
        "train",
        QUICK,
        "--gpus",
        "4x24GB",
        "--print-launch",
        "--set",
        "launch.nnodes=2",
        "--set",
        "launch.rdzv_endpoint=node0:29400",
        "--set",
        "train.per_device_batch=8",
        "--set",
        f"output.dir={tmp_path / 'run'}",
    ]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# node 0:" in p.stdout and "# node 1:" in p.stdout
    assert "--rdzv-backend c10d --rdzv-endpoint node0:29400" in p.stdout and "--nproc-per-node 4" in p.stdout
    # only the resolved job both nodes' commands read is written (tests/test_print_launch.py runs one)
    assert [str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*") if f.is_file()] == [
        "run/print-launch/job.yaml"
    ]
    assert p.stdout.count(f"--worker {tmp_path / 'run' / 'print-launch' / 'job.yaml'}") == 2


@pytest.mark.slow
def test_note_001_layout_runs_on_cpu(tmp_path):
    """examples/gspo-3gpu.yaml as written (policy on 0,1, reference on 2), with --gpus cpu mapping each
    device id to a CPU process; only the model is swapped for a built-in one (no hub here)."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("GPUFLEET_") and "__" in k)}
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gpufleet",
        "train",
        str(ROOT / "examples" / "gspo-3gpu.yaml"),
        "--gpus",
        "cpu",
        "--set",
        "model.path=builtin:tiny-qwen2",
        "--set",
        "train.max_steps=2",
        "--set",
        f"output.dir={run}",
    ]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 policy ranks on cpu processes [0, 1]; reference on scorer cpu process 2" in p.stdout
    assert sorted(x.name for x in (run / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log", "rank2.log"]
    assert (run / "final" / "model.safetensors").is_file()
