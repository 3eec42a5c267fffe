"""The colocated reward model under FSDP (issue 13 item 2): loaded in the compute dtype, frozen, sharded
over the policy ranks like the reference, and scoring as one process holding the whole model does
(gloo, 2 processes, each scoring its own texts of other lengths, as policy ranks do)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gpufleet.launch.torchrun import free_port
from gpufleet.rl.rewards import RewardModel
from helpers import gloo_done, gloo_rank
from mp_rewards import tiny_reward_model
from test_plan_measure import storage_bytes

PROMPTS = [f"{i} + {i + 1} =" for i in range(20)]
COMPLETIONS = [" " + "x" * (1 + i % 7) for i in range(20)]
HALF = len(PROMPTS) // 2  # rank r scores rows [r*HALF, (r+1)*HALF): 2 batches of 8 and 2 each


def _worker(rank: int, port: int, folder: str, out: str) -> None:
    rt = gloo_rank(rank, port)
    rows = slice(rank * HALF, (rank + 1) * HALF)
    result = {}
    for dtype in ("float32", "bfloat16"):
        rm = RewardModel(folder, rt.device, batch_size=8, dtype=dtype, shard=rt)
        params = list(rm.model.parameters())
        result[dtype] = {
            "scores": rm(PROMPTS[rows], COMPLETIONS[rows]) + rm(PROMPTS[rows][:3], COMPLETIONS[rows][:3]),
            "dtypes": sorted({str(p.dtype) for p in params}),
            "grad": any(p.requires_grad for p in params),
            "local": sum(p.to_local().numel() for p in params),
            "local_bytes": storage_bytes(p.to_local() for p in params),
            "sharded": all(hasattr(p, "to_local") for p in params),
        }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    gloo_done()


@pytest.mark.slow
def test_sharded_reward_model_scores_as_one_process(tmp_path):
    folder = str(tiny_reward_model(tmp_path / "rm"))
    out = str(tmp_path / "scores")
    mp.spawn(_worker, args=(free_port(), folder, out), nprocs=2, join=True)
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 2e-2)):
        whole = RewardModel(folder, torch.device("cpu"), batch_size=8, dtype=dtype)
        assert {p.dtype for p in whole.model.parameters()} == {getattr(torch, dtype)}
        total = sum(p.numel() for p in whole.model.parameters())
        for rank in (0, 1):
            got = json.loads(open(f"{out}.{rank}").read())[dtype]
            rows = slice(rank * HALF, (rank + 1) * HALF)
            want = whole(PROMPTS[rows], COMPLETIONS[rows]) + whole(PROMPTS[rows][:3], COMPLETIONS[rows][:3])
            assert got["scores"] == pytest.approx(want, abs=tol, rel=tol), (dtype, rank)
            assert got["dtypes"] == [f"torch.{dtype}"] and not got["grad"] and got["sharded"]
            assert got["local"] <= total // 2 + 64  # 1/2 of the weights (dim-0 shards, rounded up)
            planned = _planned_weights(folder, dtype)  # what gpufleet plan counts per rank
            assert abs(got["local_bytes"] / planned - 1) <= 0.01, (dtype, rank, got["local_bytes"], planned)


def _planned_weights(folder: str, dtype: str) -> int:
    """The planner's per-rank bytes of this reward model sharded over 2 FSDP ranks (plan/build.py)."""
    from gpufleet.config.schema import Job
    from gpufleet.plan.build import reward_model_parts
    from gpufleet.plan.shape import Models, ModelSpec, arch_from_config, count_parameters

    raw = json.loads((Path(folder) / "config.json").read_text())
    arch = arch_from_config(raw)
    spec = ModelSpec(folder, "local", arch, count_parameters(arch, "classifier"))
    precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    job = Job.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen2"},
            "train": {"precision": precision},
            "reward": {"model": folder},
        }
    )
    return reward_model_parts(job, Models(spec, spec), rows=16, tokens=32, shards=2)[0]


def test_reward_model_in_the_compute_dtype(tmp_path):
    """The policy ranks and a scorer load the reward model in the job's compute dtype, whatever dtype
    its checkpoint holds (here fp32): never an fp32 copy in a bf16 run."""
    from gpufleet.config.precision import reward_model_dtype
    from gpufleet.config.schema import Job
    from gpufleet.rl.rewards import Rewards

    folder = str(tiny_reward_model(tmp_path / "rm"))
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        job = Job.model_validate(
            {
                "model": {"path": "builtin:tiny-qwen2"},
                "train": {"precision": precision},
                "reward": {"model": folder},
            }
        )
        rewards = Rewards(
            job.reward, ["repeat/chars"], torch.device("cpu"), model_dtype=reward_model_dtype(job)
        )
        rm = rewards.fns[-1]
        assert {p.dtype for p in rm.model.parameters()} == {dtype}
        assert not any(p.requires_grad for p in rm.model.parameters())
        assert all(map(math.isfinite, rm(PROMPTS[:4], COMPLETIONS[:4])))
