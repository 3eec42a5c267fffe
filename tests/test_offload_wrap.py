"""placement.offload in the trainer's wrap (parallel.wrap_policy): FSDP2's CPUOffloadPolicy on 2 gloo
processes trains a real tiny model to the same weights as FSDP without offload. On a CPU the offload
moves nothing (pinning is off without CUDA), so this holds the code path and the optimizer step on
offloaded DTensors, not the GPU memory it saves (that is the planner's, tests/test_fit_7b.py)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from gpufleet.launch.torchrun import free_port
from helpers import gloo_done, gloo_rank


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from gpufleet.models import load_causal_lm
    from gpufleet.parallel import full_state_dict, wrap_policy

    rt = gloo_rank(rank, port)
    result = {}
    for offload in ("none", "params"):
        torch.manual_seed(0)
        model = wrap_policy(load_causal_lm("builtin:tiny-qwen2"), "fsdp", rt, None, offload)
        assert isinstance(model, FSDPModule)
        policy = model._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy) == (offload == "params")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # as rl/update.py, on offloaded grads
            opt.step()
            opt.zero_grad()
        result[offload] = full_state_dict(model, rt)
    if rank == 0:
        torch.save(result, out)
    gloo_done()


@pytest.mark.slow
def test_cpu_offload_policy_trains_like_fsdp(tmp_path):
    out = str(tmp_path / "states.pt")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    states = torch.load(out)
    plain, offloaded = states["none"], states["params"]
    assert plain.keys() == offloaded.keys()
    for k in plain:
        torch.testing.assert_close(offloaded[k], plain[k], rtol=1e-5, atol=1e-6)
    from gpufleet.models import load_causal_lm

    initial = load_causal_lm("builtin:tiny-qwen2").state_dict()
    assert any(not torch.equal(initial[k], plain[k]) for k in initial if k in plain)  # it trained
