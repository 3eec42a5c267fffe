"""Policy parallelism, applied once in a fixed place: DDP or FSDP2 over the policy ranks only.

Policy gradients are reduced only inside the policy process group. FSDP2
(`torch.distributed.fsdp.fully_shard`) shards every decoder layer and then the root (embeddings, final
norm, head), on a 1-D mesh made from the policy group. Under FSDP a colocated reference model is
sharded the same way over the same group (`shard_frozen`): frozen, no gradients ever reduced.
"""

from __future__ import annotations

import torch

from gpufleet.dist import Runtime


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a causal LM (Llama/Qwen/Mistral/Gemma: model.layers; GPT-2: h),
    also under a peft adapter; ValueError if there are none."""
    if hasattr(model, "get_base_model"):  # peft's PeftModel: the blocks are the base model's
        model = model.get_base_model()
    inner = getattr(model, "model", None) or getattr(model, "transformer", None) or model
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    if layers is None:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} (model.layers or transformer.h)"
        )
    return list(layers)


def wrap_policy(
    policy: torch.nn.Module,
    strategy: str,
    rt: Runtime,
    param_dtype: torch.dtype | None = None,
    offload: str = "none",
) -> torch.nn.Module:
    """DDP or FSDP2 over the policy group. `param_dtype` (FSDP): mixed precision, parameters gathered in
    that dtype and resharded after use, gradients reduced in float32 into the fp32 sharded master weights.
    `offload` (FSDP, `placement.offload`): `params` or `optimizer`, FSDP2's CPUOffloadPolicy: the sharded
    parameters, their gradients and the AdamW states live in host memory (the optimizer step runs on the
    CPU); each unit is copied to the GPU for its all-gather."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [rt.device.index] if rt.device.type == "cuda" else None
        return DistributedDataParallel(policy, device_ids=ids, process_group=rt.policy_group)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = (
            MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
        )
        kw: dict = {"mp_policy": mp} if mp is not None else {}
        if offload != "none":
            from torch.distributed.fsdp import CPUOffloadPolicy

            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=rt.device.type == "cuda")
        return _shard(policy, rt, **kw)
    raise ValueError(f"unknown placement.strategy {strategy!r}")


def _shard(model: torch.nn.Module, rt: Runtime, **kw) -> torch.nn.Module:
    """FSDP2 over the policy group: every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(rt.policy_group, rt.device.type)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def shard_frozen(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """A frozen model (the reference) sharded like the policy: 1/N of its weights per policy rank, each
    layer gathered for its forward and freed after; no gradients, no mixed-precision policy (it is
    loaded in the compute dtype). Every policy rank must run its forwards the same number of times."""
    model.requires_grad_(False)
    return _shard(model, rt)


def release(model: torch.nn.Module | None) -> None:
    """Free what FSDP2 keeps gathered after a no-grad forward: the root unit waits for a backward that
    a frozen model never runs (a no-op for a plain model)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def full_state_dict(model: torch.nn.Module, rt: Runtime) -> dict[str, torch.Tensor] | None:
    """The unwrapped model's full state dict on CPU (gathered from FSDP shards; a collective then)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _share_tied(model, state) if state else state
    inner = getattr(model, "module", model)  # DDP
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()} if rt.is_main else None


def _share_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Point tied names (an lm_head tied to the embeddings) at one gathered tensor, as in the module.

    The gathered state dict holds a separate copy under each name; save_pretrained then writes both,
    while a DDP or single-process run (one shared tensor) writes one: the same model, one key more."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = name if name in state else None
        if key is None:
            continue
        if id(param) in first and first[id(param)] in state:
            state[key] = state[first[id(param)]]
        else:
            first.setdefault(id(param), key)
    return state
