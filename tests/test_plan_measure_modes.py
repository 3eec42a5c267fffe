"""The memory model of issue 13's modes against measurement on the CPU (as tests/test_plan_measure.py):
FSDP2 mixed precision (bf16 gathered parameters, fp32 shards), the sharded frozen reference, and LoRA.

FSDP runs on 2 gloo processes (the trainer's own `wrap_policy` / `shard_frozen`); each rank counts its
local shards (weights, gradients, AdamW state: storages of the DTensors' local tensors) and the tensors
autograd saves in `sequence_logprobs` (the gathered bf16 parameters are FSDP's, freed after use, and
not activations: saved parameters are left out). Bars: 1% for weights / grads / optimizer, 15% for
the activations.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

from gpufleet.config.schema import ModelSection, TrainSection
from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.launch.torchrun import free_port
from gpufleet.plan.memory import Precision, train_activations, train_state_bytes, with_adapter
from gpufleet.plan.shape import arch_from_config, count_parameters
from gpufleet.rl.optim import build_optimizer
from helpers import gloo_done, gloo_rank
from test_plan_measure import SHAPES, batch, build, storage_bytes

RAW = SHAPES["qwen2 (GQA 4/2, tied, q/k/v bias)"]
PROMPT, COMPLETION = 8, 16


def saved_activations(model, ids, mask) -> int:
    """Bytes autograd keeps for backward in `sequence_logprobs`, parameters left out, counted when the
    forward is over: FSDP2 has freed each layer's gathered parameters by then (their storages have size
    0 until backward gathers them again); the logits (held by the checkpointed log-softmax) added.
    Storages are told apart by their StorageImpl (`_cdata`, kept alive here), not by address: FSDP frees
    a gathered storage in place, and the allocator may hand its address to a later saved tensor."""
    saved: dict[int, torch.UntypedStorage] = {}
    params = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
        for p in model.parameters()
    }

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().data_ptr() not in params:
            st = t.untyped_storage()
            saved.setdefault(st._cdata, st)
        return t

    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda mod, i, out: logits.append(out.logits))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = sequence_logprobs(model, ids, mask, PROMPT)
    hook.remove()
    for t in logits:
        saved.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
    held = sum(st.nbytes() for st in saved.values())
    logp.float().sum().backward()
    return held


def _local(tensors):
    return storage_bytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)


def _worker(rank: int, port: int, out: str) -> None:
    from gpufleet.parallel import release, shard_frozen, wrap_policy

    rt = gloo_rank(rank, port)
    model = wrap_policy(build(RAW), "fsdp", rt, torch.bfloat16)  # fp32 shards, bf16 compute
    opt, _ = build_optimizer(model.parameters(), TrainSection())
    ids, mask = batch(RAW["vocab_size"], PROMPT, COMPLETION)
    acts = saved_activations(model, ids, mask)
    opt.step()
    params = list(model.parameters())
    reference = shard_frozen(build(RAW, torch.bfloat16).eval(), rt)
    with torch.no_grad():
        sequence_logprobs(reference, ids, mask, PROMPT)
    release(reference)
    measured = {
        "weights": _local(params),
        "grads": _local(p.grad for p in params),
        "optimizer": _local(t for s in opt.state.values() for t in s.values() if t.dim() > 0),
        "activations": acts,
        "reference": _local(reference.parameters()),
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(measured, f)
    gloo_done()


@pytest.mark.slow
def test_fsdp_mixed_precision_and_sharded_reference_as_planned(tmp_path):
    out = str(tmp_path / "measured")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    arch = arch_from_config(build(RAW).config.to_dict())
    params = count_parameters(arch)
    state = train_state_bytes(params, Precision("float32", "float32"), shards=2, fused_adamw=False)
    acts = train_activations(
        arch,
        params,
        Precision("bfloat16", "bfloat16"),  # as plan/build.py under FSDP mixed precision
        batch=3,
        prompt_tokens=PROMPT,
        completion_tokens=COMPLETION,
        checkpointing=False,
        fused_cpu=True,  # bf16 compute: nothing fused
    ).saved
    for rank in (0, 1):
        m = json.loads(open(f"{out}.{rank}").read())
        for key in ("weights", "grads", "optimizer"):
            assert abs(m[key] / state[key] - 1) <= 0.01, (rank, key, m[key], state[key])
        assert abs(m["reference"] / (2 * math.ceil(params.total / 2)) - 1) <= 0.01, (rank, m["reference"])
        assert abs(acts / m["activations"] - 1) <= 0.15, (rank, m["activations"], acts)


@pytest.mark.parametrize("base", [torch.float32, torch.bfloat16])
def test_lora_as_planned(base):
    """A LoRA policy (all-linear, base frozen in `base`, adapter fp32 as peft makes it): weights, grads,
    AdamW state of the adapter, and the activations, against the plan of the same job."""
    from gpufleet.models.lora import adapted_width, apply, trainable_parameters
    from gpufleet.plan.memory import DTYPE_BYTES

    section = ModelSection(use_peft=True, lora_target_modules=["all-linear"], lora_dropout=0.0)
    model = apply(build(RAW, base), section).train()
    opt, _ = build_optimizer([p for p in model.parameters() if p.requires_grad], TrainSection())
    ids, mask = batch(RAW["vocab_size"], PROMPT, COMPLETION)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=base == torch.bfloat16)
    with autocast:
        acts = saved_activations(model, ids, mask)
    opt.step()
    trained = [p for p in model.parameters() if p.requires_grad]
    measured = {
        "weights": storage_bytes(model.parameters()),
        "grads": storage_bytes(p.grad for p in trained),
        "optimizer": storage_bytes(t for s in opt.state.values() for t in s.values() if t.dim() > 0),
    }
    config = model.base_model.model.config.to_dict()
    arch = arch_from_config(config)
    name = "float32" if base == torch.float32 else "bfloat16"
    adapter = trainable_parameters(config, section)
    state = train_state_bytes(count_parameters(arch), Precision(name, name), adapter=adapter)
    for key, value in measured.items():
        assert abs(state[key] / value - 1) <= 0.01, (key, value, state[key], DTYPE_BYTES[name])
    plain = train_activations(
        arch,
        count_parameters(arch),
        Precision(name, name),
        batch=3,
        prompt_tokens=PROMPT,
        completion_tokens=COMPLETION,
        checkpointing=False,
        fused_cpu=True,  # measured on the CPU: fp32 runs its norms, SwiGLU and attention fused (engine/fusedlayers.py)
    )
    width = adapted_width(config, section)
    predicted = with_adapter(plain, adapter, width, 3 * (PROMPT + COMPLETION), Precision(name, name)).saved
    assert abs(predicted / acts - 1) <= 0.15, (acts, predicted)
