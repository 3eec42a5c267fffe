"""The pieces of a fast decoder step, op by op as in the Hugging Face modules (see engine/fastdecode.py):
RMSNorm, the linear projections in the weight layout that reads fastest, one decoder layer's weights
read into them, RoPE, and the grouping of repeated prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpufleet.engine import cpu_kernels

__all__ = [
    "PROJECTIONS",
    "Norm",
    "Linear",
    "Layer",
    "rope",
    "distinct_rows",
    "attention_inputs",
    "mlp_block",
    "decode_tail",
]

_FEW_ROWS = 64
"""On a GPU, matmuls of up to this many rows (decode steps) take the transposed form (``Linear``)."""


class Norm:
    """HF ``*RMSNorm.forward`` in float32: ``weight * (x * rsqrt(mean(x**2) + eps))`` over the last dim.

    The mean is written as ``sum().div_(n)``, which is how ATen computes a float32 mean on CPU (same
    bits), and ``n`` and ``eps`` are 0-dim float32 tensors: a Python scalar costs a wrapped tensor and a
    copy on every call, and an op on the float32 value gives the same bits. ``F.rms_norm`` gives the
    same bits too, but dispatches several times more kernels on CPU.
    """

    def __init__(self, weight: torch.Tensor, eps: float, per_head: torch.Tensor | None = None):
        """``per_head`` (heads, dim): Qwen3's q_norm and k_norm applied at once, one weight row per head."""
        self.weight = weight if per_head is None else per_head
        self.per_head = per_head is not None
        self.size = torch.tensor(float(weight.shape[-1]), dtype=torch.float32, device=weight.device)
        self.eps = torch.tensor(eps, dtype=torch.float32, device=weight.device)
        self.eps_value = float(eps)

    @classmethod
    def of(cls, module: torch.nn.Module, dtype: torch.dtype | None = None) -> Norm:
        """The norm of an HF ``*RMSNorm`` module (its live weight, or a copy in ``dtype``)."""
        return cls(_in(module.weight, dtype), module.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """bfloat16 / float16 inputs are normed in float32 and cast back before the weight, as HF does
        (for float32 the casts are no-ops)."""
        if x.is_cuda:  # one fused kernel instead of seven: within 5e-7 of the formula (on an H200)
            shape = (x.shape[-1],)
            if x.dtype == torch.float32 and not self.per_head:
                return F.rms_norm(x, shape, self.weight, self.eps_value)
            return self.weight * F.rms_norm(x.float(), shape, None, self.eps_value).to(x.dtype)
        wide = x.float()
        scale = wide.pow(2).sum(-1, keepdim=True).div_(self.size).add_(self.eps).rsqrt_()
        return self.weight * (wide * scale).to(x.dtype)


class Linear:
    """``F.linear`` of 2-D inputs (N, in) through one or several ``nn.Linear`` (outputs concatenated).

    ``layout``: ``"views"`` keeps a transposed view of each weight (no copy); ``"fused"`` concatenates
    several weights (and biases) into one copy, so they run as one matmul; ``"dense"`` does that too and
    stores the copy transposed and contiguous, (in, out). For 2-D inputs ``F.linear`` is
    ``addmm(bias, x, W.t())`` or ``mm(x, W.t())``: calling those directly skips two dispatch layers. On
    CPU a decode step's few rows make a matmul bound by reading its weight; the (in, out) layout reads it
    in order: the matmuls of a step, cycled through at 16 rows, ran 1.5x faster so (bench/README.md),
    with the same bits from 8 rows up (MKL; fewer rows take a matrix-vector kernel whose sums round differently, within 1e-6).
    ``"panels"`` (CPU, float32, where ``cpu_kernels`` builds) packs the fused weight for ``cpu_kernels.matmul``
    and runs inputs of up to ``cpu_kernels.MAX_ROWS`` rows through it (about 2x the (in, out) layout's
    speed at 16 rows); longer inputs (a prefill) take ``mm`` over views of the parameters.
    On a GPU, inputs of up to ``_FEW_ROWS`` rows are multiplied as ``(W x^T)^T``: at 16 rows cuBLAS
    picks faster kernels for that form (H200, float32: Qwen2.5-0.5B's down projection 22 vs 39 us, its
    head 246 vs 332 us; the same as an (in, out) copy of the weight, without the copy).
    """

    def __init__(self, *modules: torch.nn.Linear, layout: str = "fused", dtype: torch.dtype | None = None):
        """``dtype``: copies of the weights (and biases) in that dtype (``FastDecoder``'s decode dtype)."""
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules], dim=0)
        self.packed = None
        if layout == "panels":
            self.packed = cpu_kernels.pack([m.weight for m in modules], bias)
        if layout == "dense":
            self.parts = [(torch.cat([m.weight.t() for m in modules], dim=1).contiguous(), bias)]
        elif layout == "fused" and len(modules) > 1:
            self.parts = [(torch.cat([m.weight for m in modules], dim=0).t(), bias)]
        else:
            self.parts = [(m.weight.t(), m.bias) for m in modules]
        self.parts = [(_in(w, dtype), _in(b, dtype)) for w, b in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= cpu_kernels.MAX_ROWS:
            return cpu_kernels.matmul(x, self.packed)
        if x.is_cuda and x.shape[0] <= _FEW_ROWS:  # (W x^T)^T: cuBLAS's faster kernels for few rows
            outs = [
                (torch.mm(wt.t(), x.t()) if b is None else torch.addmm(b[:, None], wt.t(), x.t())).t()
                for wt, b in self.parts
            ]
        else:
            outs = [torch.mm(x, wt) if b is None else torch.addmm(b, x, wt) for wt, b in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass
class Layer:
    """One decoder layer's weights (views of the model's parameters, or fused copies of them)."""

    input_norm: Norm
    qkv: Linear
    qk_norm: Norm | None
    """Qwen3: q_norm on the query heads and k_norm on the key heads, at once."""
    o_proj: Linear
    post_norm: Norm
    gate_up: Linear
    down: Linear

    @classmethod
    def of(cls, layer: torch.nn.Module, layout: str, dtype: torch.dtype | None = None) -> Layer:
        """The weights of an HF decoder layer in ``layout`` (see ``Linear``), copies in ``dtype`` if given."""
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        if hasattr(attn, "q_norm"):
            heads = attn.q_proj.out_features // attn.head_dim
            kv_heads = attn.k_proj.out_features // attn.head_dim
            rows = [attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)]
            per_head = _in(torch.cat(rows, dim=0), dtype)
            qk_norm = Norm(_in(attn.q_norm.weight, dtype), attn.q_norm.variance_epsilon, per_head)
        return cls(
            input_norm=Norm.of(layer.input_layernorm, dtype),
            qkv=Linear(attn.q_proj, attn.k_proj, attn.v_proj, layout=layout, dtype=dtype),
            qk_norm=qk_norm,
            o_proj=Linear(attn.o_proj, layout=layout, dtype=dtype),
            post_norm=Norm.of(layer.post_attention_layernorm, dtype),
            gate_up=Linear(mlp.gate_proj, mlp.up_proj, layout=layout, dtype=dtype),
            down=Linear(mlp.down_proj, layout=layout, dtype=dtype),
        )


def _in(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype`` (itself when None or already so)."""
    return t if t is None or dtype is None else t.to(dtype)


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each distinct prompt (ids and mask) and, per row, the index of its prompt there."""
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    order = torch.arange(len(rows), device=rows.device)
    first = torch.full((int(inverse.max()) + 1,), len(rows), device=rows.device)
    return first.scatter_reduce_(0, inverse, order, "amin"), inverse


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` for one tensor, ``x * cos + rotate_half(x) * sin``, bit for bit.

    ``sin = cat(s, s)`` (``*RotaryEmbedding.forward``), so ``rotate_half(x) * sin = cat(-x2 * s, x1 * s)``
    ``= roll(x, D/2) * cat(-s, s)``: ``signed_sin`` is ``cat(-s, s)``; negation is exact.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def attention_inputs(
    layer: Layer,
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (..., H, D) and k, v (..., H_kv, D) of hidden states x (..., hidden): the input norm, q/k/v,
    Qwen3's q/k norms, RoPE on q and k (``*Attention.forward`` up to the attention)."""
    qk_heads = heads + kv_heads
    qkv = layer.qkv(layer.input_norm(x)).unflatten(-1, (qk_heads + kv_heads, head_dim))
    qk, v = qkv[..., :qk_heads, :], qkv[..., qk_heads:, :]
    if layer.qk_norm is not None:  # Qwen3: q_norm / k_norm over head_dim, before RoPE
        qk = layer.qk_norm(qk)
    qk = rope(qk, cos, signed_sin)
    return qk[..., :heads, :], qk[..., heads:, :], v


def mlp_block(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """x + MLP(post_attention_layernorm(x)): ``down(silu(gate(h)) * up(h))``."""
    gate, up = layer.gate_up(layer.post_norm(x)).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up)


def decode_tail(layer: Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer after its attention (B, H*D): the output projection, the residual,
    the MLP block."""
    return mlp_block(layer, x + layer.o_proj(attended))
