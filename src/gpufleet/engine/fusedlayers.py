"""The training forward's RMSNorm, SwiGLU and attention on CPU: the norm and the SwiGLU one C pass each
way, RoPE one C pass each way, SDPA over the key/value heads as they are.

Hugging Face's ``*RMSNorm`` is six tensor operations (power, mean, add, rsqrt, two products) and its
backward under autograd about ten more; ``act_fn(gate) * up`` is two operations and three backward. On
the CPU each of them is a pass over (batch x tokens x width) floats, a fresh allocation and its page
faults: in the ``small`` benchmark's policy forward + backward the norms took about 8% and the SwiGLU
about 7% of the time, the matmuls around them 68%. Here (``layer_kernels.c``: ``gpufleet_rms_*``,
``gpufleet_swiglu_*``) each is one pass forward and one backward, saving for backward only its input (the
norm: and one float per row; the SwiGLU: gate and up, not the activation too). The attention module's
RoPE (``apply_rotary_pos_emb``: a ``cat``, a negation, two products and a sum for q and for k, each
with its backward) is one pass (``gpufleet_rope_*``) that also writes q and k in the layout SDPA takes,
and SDPA gets the key/value heads with ``enable_gqa`` instead of ``repeat_kv``'s copies for every query
head (Hugging Face passes ``enable_gqa`` only without a mask, for CUDA's sake); the ``small`` model's
forward + backward took 12% less time so (387 vs 439 ms, best of 12 alternating runs). A packed row
(engine/packing.py) attends within each of its sequences (``packed_attention``, a C kernel; ``packed_mask`` for a
module's own forward).

``fused_layers(model)`` swaps the ``forward`` of the supported modules (``NORM_CLASSES``,
``ATTENTION_CLASSES``, and the ``MLP_CLASSES`` whose activation is SiLU) for the length of a block, as
``loghead.fused_head`` swaps the head; ``sequence_logprobs`` uses it around its forward. It applies only
where all of this holds: the model's first parameter is a float32 CPU tensor, the C kernels run here
(``cpu_kernels.available``), no layer is compiled (``train.torch_compile``: the compiled layers trace the
modules' own code), no layer is checkpointed in a forward that keeps gradients
(``model.gradient_checkpointing``: its recomputation in backward runs after the block, with the modules'
own code), and ``GPUFLEET_FUSED_LAYERS`` is not 0. Each call checks its own input too (float32, on the
CPU; the attention: SDPA the model's attention function, no cache, no autocast) and takes the module's
own forward otherwise.

Results differ from the torch operations by rounding only (the row's sum of squares in another order,
Cephes' ``expf``): forward within 1e-6 relative, gradients within a few 1e-6 (tested). The attention
module has the same bits as its own code, forward and backward (RoPE rounds as torch does; SDPA's
grouped heads sum as the repeated ones; tested). TRL's gradient equality: bench/trl_grad_equal.py.
They do not depend on the thread count; each row's result does not depend on the other rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gpufleet.engine import cpu_kernels
from gpufleet.engine.packedattention import packed_attention, packed_mask, window_of
from gpufleet.engine.switches import FUSED_LAYERS, switched_off

__all__ = [
    "ATTENTION_CLASSES",
    "ENV",
    "MLP_CLASSES",
    "NORM_CLASSES",
    "attention",
    "fused_layers",
    "packed_attention",
    "packed_mask",
    "packs",
    "rms_norm",
    "swiglu",
]

ENV = FUSED_LAYERS
"""Set to 0 to run the models' own RMSNorm, attention and MLP code in the training forward on CPU."""

NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Phi3RMSNorm",
        "Olmo2RMSNorm",
    }
)
"""Norms computing ``weight * (x * rsqrt(mean(x^2) + variance_epsilon))`` over the last dimension
(transformers 5.23's code; Gemma's ``1 + weight`` is not one of them)."""

MLP_CLASSES = frozenset(
    {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP", "Olmo2MLP"}
)
"""MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; fused where ``act_fn`` is SiLU."""

ATTENTION_CLASSES = frozenset(
    {
        "LlamaAttention",
        "MistralAttention",
        "Qwen2Attention",
        "Qwen2MoeAttention",
        "Qwen3Attention",
        "Qwen3MoeAttention",
    }
)
"""Attention modules computing q / k / v projections (Qwen3: each head's q and k through ``q_norm`` /
``k_norm``), RoPE by ``apply_rotary_pos_emb``, the model's attention function, ``o_proj``; fused (RoPE in
C, SDPA with grouped heads) where that function is SDPA."""

_NORM_BLOCK = 32
"""Rows per partial sum of the norm's weight gradient: ``NORM_BLOCK`` in ``layer_kernels.c``."""


def _threads() -> int:
    return torch.get_num_threads()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        lib = cpu_kernels.library()
        x = x.contiguous()
        n = x.shape[-1]
        rows = x.numel() // n
        out = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        w = weight.detach().contiguous()
        lib.gpufleet_rms_forward(
            x.data_ptr(), w.data_ptr(), eps, rows, n, out.data_ptr(), rstd.data_ptr(), _threads()
        )
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        lib = cpu_kernels.library()
        x, w, rstd = ctx.saved_tensors
        gy = gy.contiguous()
        n, rows = x.shape[-1], rstd.numel()
        gx = torch.empty_like(x)
        gw = partial = None
        if ctx.needs_input_grad[1]:
            gw = torch.empty(n, dtype=torch.float32)
            partial = torch.empty(-(-rows // _NORM_BLOCK), n, dtype=torch.float32)
        lib.gpufleet_rms_backward(
            x.data_ptr(),
            w.data_ptr(),
            rstd.data_ptr(),
            gy.data_ptr(),
            rows,
            n,
            gx.data_ptr(),
            None if gw is None else gw.data_ptr(),
            None if partial is None else partial.data_ptr(),
            _threads(),
        )
        return gx, gw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        lib = cpu_kernels.library()
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        lib.gpufleet_swiglu_forward(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr(), _threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, gh: torch.Tensor):
        lib = cpu_kernels.library()
        gate, up = ctx.saved_tensors
        gh = gh.contiguous()
        gg, gu = torch.empty_like(gate), torch.empty_like(up)
        lib.gpufleet_swiglu_backward(
            gate.data_ptr(),
            up.data_ptr(),
            gh.data_ptr(),
            gate.numel(),
            gg.data_ptr(),
            gu.data_ptr(),
            _threads(),
        )
        return gg, gu


class _Rope(torch.autograd.Function):
    """x (B, T, H, D) -> RoPE(x) as (B, H, T, D), contiguous; ``cos``, ``sin``: (B or 1, T, D)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, heads, d = x.shape
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = x.new_empty(batch, heads, tokens, d)
        cs_batch = 0 if cos.shape[0] == 1 else tokens * d
        cpu_kernels.library().gpufleet_rope_forward(
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cs_batch,
            batch,
            tokens,
            heads,
            d,
            out.data_ptr(),
            _threads(),
        )
        ctx.save_for_backward(cos, sin)
        ctx.cs_batch = cs_batch
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        g = g.contiguous()
        batch, heads, tokens, d = g.shape
        gx = g.new_empty(batch, tokens, heads, d)
        cpu_kernels.library().gpufleet_rope_backward(
            g.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            ctx.cs_batch,
            batch,
            tokens,
            heads,
            d,
            gx.data_ptr(),
            _threads(),
        )
        return gx, None, None


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module`` (one of ``NORM_CLASSES``) applied to ``x``: fused when both are float32 on the CPU."""
    if _fits(x, module.weight) and x.shape[-1] == module.weight.numel():
        return _RMSNorm.apply(x, module.weight, float(module.variance_epsilon))
    return type(module).forward(module, x)


def swiglu(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module`` (one of ``MLP_CLASSES``) applied to ``x``, its SiLU product fused when float32 on the CPU."""
    gate, up = module.gate_proj(x), module.up_proj(x)
    if _fits(gate, up) and gate.shape == up.shape:
        return module.down_proj(_SwiGLU.apply(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def attention(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``module`` (one of ``ATTENTION_CLASSES``) as its own forward computes it, with RoPE one C pass each
    way that also lays q and k out for SDPA, and SDPA given the key/value heads as they are
    (``enable_gqa``) instead of copies repeated for every query head. Only without a cache, with the
    model's attention function SDPA, no attention dropout in training, float32 CPU inputs and weights and
    no autocast; otherwise the module's own forward."""
    cos, sin = position_embeddings
    own = (
        past_key_values is not None
        or module.config._attn_implementation != "sdpa"
        or (module.training and module.attention_dropout > 0)
        or kwargs.get("output_attentions")
        or cos.requires_grad
        or not _fits(hidden_states, cos, sin, module.q_proj.weight, module.k_proj.weight)
        or torch.is_autocast_enabled("cpu")  # the projections would be in another dtype
        or cos.shape != sin.shape
        or cos.dim() != 3
        or cos.shape[0] not in (1, hidden_states.shape[0])
        or module.head_dim % 2
    )
    batch, tokens = hidden_states.shape[:2]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and own:  # a packed row (engine/packing.py) through the module's own forward
        attention_mask = packed_mask(cu, tokens, window_of(module))  # the model was given a placeholder
        if module.config._attn_implementation == "eager":  # an additive mask, as HF's eager_mask
            attention_mask = hidden_states.new_zeros(attention_mask.shape).masked_fill(
                ~attention_mask, torch.finfo(hidden_states.dtype).min
            )
        elif module.config._attn_implementation != "sdpa":
            raise RuntimeError(
                f"a packed row needs SDPA or eager attention, not {module.config._attn_implementation}"
            )
    if own:
        return type(module).forward(
            module, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    shape = (batch, tokens, -1, module.head_dim)
    q, k = module.q_proj(hidden_states).view(shape), module.k_proj(hidden_states).view(shape)
    if hasattr(module, "q_norm"):  # Qwen3: RMSNorm over each head
        q, k = module.q_norm(q), module.k_norm(k)
    q, k = _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)
    v = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    if cu is not None:
        out = packed_attention(q, k, v, cu, int(kwargs["max_length_q"]), module.scaling, window_of(module))
        return module.o_proj(out), None
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attention_mask,
        scale=module.scaling,
        is_causal=attention_mask is None and tokens > 1 and getattr(module, "is_causal", True),
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return module.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1)), None


def packs(model: torch.nn.Module) -> bool:
    """Whether a packed forward of ``model`` (engine/packing.py) runs every attention module fused, each
    attending within the packed sequences at the cost of their own lengths (SDPA the attention function,
    no attention dropout in training, no autocast); see ``_swaps`` for the rest."""
    if torch.is_autocast_enabled("cpu"):
        return False
    every = list(model.modules())
    fused = {id(module) for module, forward in _swaps(model, every) if forward is attention}
    modules = [m for m in every if type(m).__name__.removeprefix("FSDP") in ATTENTION_CLASSES]
    return bool(modules) and all(
        id(m) in fused
        and m.config._attn_implementation == "sdpa"
        and not (m.training and m.attention_dropout > 0)
        for m in modules
    )


def _gathered_in_low_precision(modules: list[torch.nn.Module]) -> bool:
    """FSDP2 mixed precision: float32 shards gathered in another dtype for the forward (MixedPrecisionPolicy's
    ``param_dtype``, read from FSDP's state; where that is not found, False and each call checks its own
    input as before). ``modules``: the model's."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        if isinstance(module, FSDPModule):
            state = getattr(module, "_get_fsdp_state", lambda: None)()
            dtype = getattr(getattr(state, "_mp_policy", None), "param_dtype", None)
            return dtype not in (None, torch.float32)
    return False


def _swaps(model: torch.nn.Module, modules: list | None = None) -> list[tuple[torch.nn.Module, object]]:
    """The (module, fused forward) pairs of ``model`` (``modules``: its modules, where the caller has them);
    none where fusing does not apply (see the module docstring)."""
    from transformers.activations import SiLUActivation

    first = next(model.parameters(), None)
    modules = list(model.modules()) if modules is None else modules
    if first is None or switched_off(ENV) or not _fits(first) or _gathered_in_low_precision(modules):
        return []
    grad = torch.is_grad_enabled()
    swaps = []
    for module in modules:
        if getattr(module, "_compiled_call_impl", None) is not None:
            return []
        if grad and module.training and getattr(module, "gradient_checkpointing", False) is True:
            return []  # the layers are recomputed in backward, after the block: as they ran first
        name = type(module).__name__.removeprefix("FSDP")  # fully_shard makes the class FSDP<name>
        if "forward" in module.__dict__:  # someone else's instance forward (a hook library's): left alone
            continue
        if name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            swaps.append((module, rms_norm))
        elif name in ATTENTION_CLASSES:
            swaps.append((module, attention))
        elif name in MLP_CLASSES and isinstance(
            getattr(module, "act_fn", None), (torch.nn.SiLU, SiLUActivation)
        ):
            swaps.append((module, swiglu))
    return swaps if swaps and cpu_kernels.available() else []


@contextlib.contextmanager
def fused_layers(model: torch.nn.Module) -> Iterator[None]:
    """For the length of the block, the supported norms, attention modules and MLPs of ``model`` run fused (see the module
    docstring); nothing changes where the conditions do not hold. Restored after."""
    swaps = _swaps(model)
    for module, fused in swaps:
        module.forward = fused.__get__(module)
    try:
        yield
    finally:
        for module, _ in swaps:
            del module.forward
