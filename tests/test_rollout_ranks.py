"""Dedicated rollout ranks (`placement.rollout`, rl/rollouts.py): the layout checks itself, `plan` has a
row for each rollout device, and a job sampled on a rollout rank trains to the same weights as the same
job sampled on its policy ranks (real torchrun processes on the CPU, the installed command, from a
user's folder)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpufleet.engine.rollout import Rollout
from gpufleet.rl.rollouts import buckets, wire
from gpufleet.topology import Topology
from helpers import run_user, sets

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "examples" / "quickstart.yaml"


def test_rollout_ranks_come_after_the_scorers_on_each_node():
    topo = Topology(2, (0, 1), ((2, ("reference",)),), True, (3,))
    assert topo.nproc_per_node == 4 and topo.world_size == 8
    places = topo.places()
    assert [(q.rank, q.role, q.device) for q in places[:4]] == [
        (0, "policy", 0),
        (1, "policy", 1),
        (2, "scorer", 2),
        (3, "rollout", 3),
    ]
    assert (places[7].rank, places[7].node, places[7].local, places[7].role) == (7, 1, 3, "rollout")
    assert topo.devices == (0, 1, 2, 3)
    assert "rollout on cpu process 3" in topo.describe()
    with pytest.raises(ValueError, match="rollout devices \\[3, 3\\] repeat an id"):
        Topology(1, (0,), (), True, (3, 3))


def test_buckets_cut_both_ends_alike():
    """Buckets of at most `limit` bytes, a larger tensor alone, and never two dtypes in one."""
    f32 = [("a", "float32", 1), ("b", "float32", 1), ("c", "float32", 1)]
    assert buckets(f32, limit=8) == [range(0, 2), range(2, 3)]
    assert buckets([("e", "float32", 5), *f32[:2]], limit=8) == [range(0, 1), range(1, 3)]
    assert buckets([("a", "bfloat16", 2), ("b", "float32", 1)], limit=64) == [range(0, 1), range(1, 2)]
    assert buckets([], limit=8) == []


def test_the_wire_is_the_rollout_dtype_for_a_model_and_their_own_for_adapters():
    model = torch.nn.Linear(2, 3)
    assert wire(model, torch.bfloat16) == [("weight", "bfloat16", 6), ("bias", "bfloat16", 3)]
    model.peft_config = {}  # what a peft model has
    assert wire(model, torch.bfloat16) == [("weight", "float32", 6), ("bias", "float32", 3)]


def test_rows_are_what_generate_gives_them_alone():
    """A rollout rank answers each policy rank with its rows padded only as wide as they need."""
    pad = 0
    prompt = torch.tensor([[pad, pad, 5], [7, 8, 9], [pad, 4, 4]])
    prompt_mask = (prompt != pad).long()
    completion = torch.tensor([[3, 1, pad], [2, pad, pad], [6, 6, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    r = Rollout(
        prompt, prompt_mask, completion, completion_mask, completion_mask.sum(1), torch.tensor([0, 1, 0])
    )
    first = r.rows(0, 1)
    assert first.prompt_ids.tolist() == [[5]] and first.completion_ids.tolist() == [[3, 1]]
    both = r.rows(1, 3)
    assert both.prompt_ids.tolist() == [[7, 8, 9], [pad, 4, 4]]
    assert both.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert both.is_truncated.tolist() == [1, 0]


def _check(tmp_path, gpus: str, *values: str):
    return run_user("check", str(QUICK), "--gpus", gpus, *sets(*values), cwd=tmp_path)


def test_check_refuses_rollout_layouts_that_cannot_work(tmp_path):
    p = _check(tmp_path, "3x24GB", "placement.policy=0", "placement.rollout=1,2")
    assert p.returncode == 2
    assert "2 rollout devices [1, 2] for 1 policy rank per node" in p.stdout
    assert "--set placement.rollout=1" in p.stdout
    p = _check(tmp_path, "2x24GB", "placement.policy=0,1", "placement.rollout=1")
    assert p.returncode == 2 and "dedicated rollout device" in p.stdout, p.stdout
    assert "--set placement.policy=0" in p.stdout
    p = _check(tmp_path, "2x24GB", "placement.policy=0", "placement.rollout=5")
    assert p.returncode == 2 and "device 5 does not exist" in p.stdout
    p = _check(tmp_path, "3x24GB", "placement.rollout=2")
    assert p.returncode == 0, p.stdout
    assert "2 policy ranks on devices [0, 1]; rollout on device 2; 3 processes" in p.stdout


def test_plan_has_a_row_for_the_rollout_device(tmp_path):
    p = run_user(
        "plan", str(QUICK), "--gpus", "3x24GB", "--format", "json", *sets("placement.rollout=2"), cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr
    devices = json.loads(p.stdout)["plan"]["devices"]
    assert [d["roles"] for d in devices] == [["policy rank 0"], ["policy rank 1"], ["rollout rank 0"]]
    proc = devices[2]["processes"][0]
    assert proc["peak_phase"] == "rollout" and proc["grads"] == 0 and proc["optimizer"] == 0
    policy = devices[0]["processes"][0]
    p = run_user("plan", str(QUICK), "--gpus", "3x24GB", "--format", "json", cwd=tmp_path)
    colocated = json.loads(p.stdout)["plan"]["devices"][0]["processes"][0]
    # the same weights in fp32 (the compute dtype) and both policy ranks' rows sampled at once
    assert proc["detail"]["policy_weights"] == policy["detail"]["policy_weights"]
    assert proc["detail"]["kv_cache"] == 2 * colocated["detail"]["kv_cache"] > 0
    assert (
        policy["detail"]["kv_cache"] == 0
        and "rollout" not in policy["phases"]
        or not policy["phases"]["rollout"]
    )


COMMON = (
    "train.max_steps=10",
    "train.per_device_batch=16",
    "train.learning_rate=1e-3",
    "output.save_every=0",
    "train.log_every=5",
)


def _train(run: Path, cwd: Path, *values: str):
    p = run_user("train", "job.yaml", *sets(*COMMON, f"output.dir={run}", *values), cwd=cwd, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The final model's weights (a LoRA run saves its adapters: adapter_model.safetensors)."""
    (saved,) = (run / "final").glob("*model.safetensors")
    return load_file(saved)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, tol: float = 1e-5) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    worst = max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)
    assert worst <= tol, worst
    assert [m["reward"] for m in _metrics(a)] == pytest.approx([m["reward"] for m in _metrics(b)], abs=1e-6)


@pytest.fixture
def user_dir(tmp_path) -> Path:
    (tmp_path / "job.yaml").write_text(QUICK.read_text())
    return tmp_path


def test_a_rollout_rank_trains_to_the_colocated_weights(user_dir):
    colocated, remote = user_dir / "runs" / "colocated", user_dir / "runs" / "remote"
    _train(colocated, user_dir)
    p = _train(remote, user_dir, "placement.rollout=1")
    assert "1 policy rank on cpu process [0]; rollout on cpu process 1" in p.stdout
    assert "rollout rank 1 on cpu: serving 1 policy rank(s)" in (remote / "logs" / "rank1.log").read_text()
    from gpufleet.models.builtin import materialize

    initial = load_file(materialize("tiny-qwen2") / "model.safetensors")  # trained: not two untouched models
    assert any(not torch.equal(initial[k], v) for k, v in _weights(remote).items())
    assert_same_run(colocated, remote)
    rows = _metrics(remote)
    assert all(0 < m["timing/weight_sync"] < m["step_time"] for m in rows)  # a push after every step
    assert "timing/weight_sync" not in _metrics(colocated)[0]
    sample = json.loads((remote / "devices.jsonl").read_text().splitlines()[0])  # the monitor names it
    assert [r["role"] for r in sample["ranks"]] == ["policy", "rollout"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("placement.strategy=ddp",), id="ddp"),
        pytest.param(("placement.strategy=fsdp",), id="fsdp"),
        pytest.param(("model.use_peft=true", "model.lora_r=4", "train.learning_rate=1e-2"), id="lora"),
    ],
)
def test_two_policy_ranks_and_a_rollout_rank_equal_two_colocated(user_dir, extra):
    """DDP, FSDP (the shards gathered for each push) and LoRA (the adapters pushed): 2 policy ranks
    sampling on a third process train as the same 2 ranks sampling their own rows."""
    two = ("placement.policy=0,1", "train.per_device_batch=8", *extra)
    colocated, remote = user_dir / "runs" / "colocated", user_dir / "runs" / "remote"
    _train(colocated, user_dir, *two)
    p = _train(remote, user_dir, *two, "placement.rollout=2")
    assert "2 policy ranks on cpu processes [0, 1]; rollout on cpu process 2" in p.stdout
    assert_same_run(colocated, remote)


def test_check_refuses_async_where_it_cannot_work(tmp_path):
    p = _check(tmp_path, "2x24GB", "rollout.async_steps=1")
    assert (
        p.returncode == 2 and "rollout.async_steps 1 generates ahead on dedicated rollout ranks" in p.stdout
    )
    agent = ROOT / "examples" / "agent-keys.yaml"
    p = run_user(
        "check",
        str(agent),
        "--gpus",
        "3x24GB",
        *sets("placement.rollout=2", "rollout.async_steps=1"),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout  # the rollout rank plays whole episodes (tests/test_rollout_env.py)
    assert "importance-sampling correction" not in p.stdout
    p = _check(tmp_path, "2x24GB", "algorithm.importance_sampling_clip_min=4")
    assert (
        p.returncode == 2
        and "importance_sampling_clip_min 4.0 >= importance_sampling_clip_max 3.0" in p.stdout
    )
    p = _check(tmp_path, "2x24GB", "algorithm.importance_sampling_clip_max=null")
    assert p.returncode == 2 and "with no upper bound a completion sampled far" in p.stdout


ASYNC = ("placement.rollout=1", "rollout.async_steps=1", "output.save_every=3")


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_a_batch_ahead_is_sampled_with_the_weights_of_a_step_before(user_dir):
    """async_steps 1: batch g is sampled while g - 1 trains, so from the second step on it is one step
    stale; its sampling log-probs (the rollout rank's) meet the trainer's in TRL's truncated IS ratio."""
    run = user_dir / "runs" / "async"
    _train(run, user_dir, *ASYNC)
    rows = _metrics(run)
    assert [m["rollout/staleness"] for m in rows] == [0.0] + [1.0] * 9
    first, later = rows[0], rows[1:]
    # the same fp32 weights: the same log-probs (recorded while decoding: the decode's rounding)
    assert first["sampling/sampling_logp_difference/max"] < 1e-5
    assert abs(first["sampling/importance_sampling_ratio/min"] - 1) < 1e-5
    assert abs(first["sampling/importance_sampling_ratio/max"] - 1) < 1e-5
    assert all(m["sampling/sampling_logp_difference/mean"] > 0 for m in later)  # one step stale
    assert all(m["sampling/importance_sampling_ratio/max"] <= 3.0 for m in rows)  # sequence_mask at 3.0
    assert all(m["timing/rollout_wait"] >= 0 and m["timing/weight_sync"] >= 0 for m in rows)
    assert "1 batch(es) ahead" in (run / "logs" / "rank1.log").read_text()


@pytest.mark.slow
def test_async_does_not_depend_on_the_policy_rank_count(user_dir):
    """One step ahead, 2 policy ranks served by one rollout rank (each sent its rows, the IS weights formed in
    each rank's loss, TRL's metrics over both, the batches in flight flushed at each checkpoint) train as 1
    policy rank with the same global batch."""
    one, two = user_dir / "runs" / "one", user_dir / "runs" / "two"
    _train(one, user_dir, *ASYNC)
    _train(two, user_dir, *ASYNC, "placement.policy=0,1", "placement.rollout=2", "train.per_device_batch=8")
    assert_same_run(one, two)
    keys = [k for k in _metrics(one)[0] if k.startswith(("sampling/", "rollout/staleness"))]
    assert len(keys) == 6
    for a, b in zip(_metrics(one), _metrics(two), strict=True):
        assert [b[k] for k in keys] == pytest.approx([a[k] for k in keys], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_async_is_deterministic_and_resumes_exactly_after_kill_9(user_dir):
    """Two runs with the same seed give the same weights; a run whose policy rank dies by SIGKILL after
    the step-3 checkpoint resumes (the batch in flight saved with it) to the same weights, bit for bit."""
    one, two = user_dir / "runs" / "one", user_dir / "runs" / "two"
    _train(one, user_dir, *ASYNC)
    kill = {"GPUFLEET_TEST_CRASH": "0:5", "GPUFLEET_TEST_KILL": "1"}
    p = run_user(
        "train",
        "job.yaml",
        *sets(*COMMON, f"output.dir={two}", *ASYNC),
        cwd=user_dir,
        env_extra=kill,
        timeout=400,
    )
    assert p.returncode != 0 and (two / "checkpoints" / "step-3" / "batch-rank0.pt").is_file()
    assert "in_flight" in torch.load(two / "checkpoints" / "step-3" / "batch-rank0.pt", weights_only=True)
    p = _train(two, user_dir, *ASYNC)
    assert "resuming from" in p.stdout
    wa, wb = _weights(one), _weights(two)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["reward"] for m in _metrics(one)] == [m["reward"] for m in _metrics(two)]


@pytest.mark.slow
def test_rollout_and_scorer_ranks_together_equal_colocated(user_dir):
    """A rollout rank beside a scorer rank holding the reference (beta > 0): the same run as both colocated."""
    common = ("algorithm.beta=0.1", "rollout.min_completion_length=4")
    colocated, remote = user_dir / "runs" / "colocated", user_dir / "runs" / "remote"
    _train(colocated, user_dir, *common)
    p = _train(
        remote, user_dir, *common, "placement.policy=0", "placement.rollout=1", "placement.reference=2"
    )
    assert "rollout on cpu process 1" in p.stdout and "reference on scorer cpu process 2" in p.stdout
    assert_same_run(colocated, remote)
    assert _metrics(remote)[-1]["kl"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_env_job_plays_both_ranks_episodes_on_the_rollout_rank(tmp_path, strategy):
    """An agent job (env servers, 3 turns): 2 policy ranks (DDP; FSDP: colocated they play in step) whose
    episodes one rollout rank plays (both ranks' rows at once, each sent its own back) train as the 2 ranks
    playing their own episodes."""
    job = ROOT / "examples" / "agent-keys.yaml"
    (tmp_path / "job.yaml").write_text(job.read_text())
    two = ("placement.policy=0,1", "train.per_device_batch=16", "train.max_steps=4", "output.save_every=0")
    two += (f"placement.strategy={strategy}",)
    colocated, remote = tmp_path / "runs" / "colocated", tmp_path / "runs" / "remote"
    for run, extra in ((colocated, ()), (remote, ("placement.rollout=2",))):
        p = run_user("train", "job.yaml", *sets(*two, f"output.dir={run}", *extra), cwd=tmp_path, timeout=400)
        assert p.returncode == 0, p.stdout + p.stderr
    assert_same_run(colocated, remote)


@pytest.mark.slow
def test_lora_adapters_travel_in_their_own_dtype_under_bf16(user_dir):
    """bf16 compute: the rollout rank's base is bf16 and peft keeps the adapters in fp32 on both ends; a push
    in the wrong dtype reads garbage (NaN loss, or every completion the same). The sampler then agrees with
    the trainer up to bf16 rounding."""
    lora = ("model.use_peft=true", "model.lora_r=4", "train.learning_rate=1e-2", "train.precision=bf16")
    run = user_dir / "runs" / "bf16"
    _train(run, user_dir, *lora, "placement.rollout=1", "train.max_steps=4")
    rows = _metrics(run)
    assert all(abs(m["sampling/importance_sampling_ratio/mean"] - 1) < 0.01 for m in rows)
    assert all(m["sampling/sampling_logp_difference/max"] < 0.1 for m in rows)
    assert all(math.isfinite(m["loss"]) for m in rows)
