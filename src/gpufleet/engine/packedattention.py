"""Attention within each sequence of a packed row (engine/packing.py), for the fused CPU attention
(``fusedlayers.attention``): one C pass each way over the packed row as it lies
(``attention_kernels.c``), the mask of a packed row for a module's own forward, and the sliding window a
layer has as its model chooses it.

Before the C kernel, the sequences were gathered into a padded (rows x longest) layout for one SDPA call
and scattered back (in backward too): on the ``small`` benchmark's batches the kernel made the policy
forward + backward + optimizer 250 vs 296 ms and the reference forward 79 vs 90 ms (best of 8,
alternating, same batches), its attention alone about 3x faster (SDPA's CPU flash kernel at these
lengths, ~50 tokens and 64-wide heads, ran at ~20 GFLOP/s)."""

from __future__ import annotations

import math

import torch

from gpufleet.engine import cpu_kernels

__all__ = ["packed_attention", "packed_mask", "window_of"]


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    longest: int,
    scale: float,
    window: float = float("inf"),
) -> torch.Tensor:
    """Causal attention within each of the packed sequences that ``cu_seq_lens`` (B + 1,) delimits
    (engine/packing.py), each query seeing its last ``window`` keys at most: q (1, H, total, D), k and v
    (1, KV heads, total, D), float32 on the CPU, any strides with D contiguous -> (1, total, H x D).
    ``longest``: the longest sequence's tokens. One C pass each way (``attention_kernels.c``), nothing
    computed for padding or above the diagonal; query head h reads key/value head h // (H / KV), as
    ``repeat_kv`` lays them out. Saved for backward: q, k, v, the output and one float per query and
    head (the log-sum-exp; the probabilities are recomputed), as SDPA's flash kernel saves."""
    return _Attention.apply(q, k, v, cu_seq_lens, int(longest), float(scale), window)


def _strides(*tensors: torch.Tensor) -> list[int]:
    """Each tensor's head and token strides, in floats: (1, heads, tokens, D) or (tokens, heads, D)."""
    return [
        s
        for t in tensors
        for s in ((t.stride(1), t.stride(2)) if t.dim() == 4 else (t.stride(1), t.stride(0)))
    ]


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, longest, scale, window):
        if any(x.dtype != torch.float32 or x.device.type != "cpu" for x in (q, k, v)):
            raise ValueError(f"packed_attention takes float32 CPU tensors, not {q.dtype} on {q.device}")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        cu = cu.to(device="cpu", dtype=torch.int32).contiguous()
        heads, total, d = q.shape[1:]
        if (
            q.shape[0] != 1
            or k.shape != v.shape
            or k.shape[::2] != q.shape[::2]
            or heads % k.shape[1]
            or int(cu[0]) != 0
            or int(cu[-1]) != total
            or bool((cu[1:] < cu[:-1]).any())
            or window < 1
        ):
            raise ValueError(
                f"packed_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, sequences "
                f"{cu.tolist()} and window {window} are not one packed row of whole heads"
            )
        longest = max(longest, int((cu[1:] - cu[:-1]).max()))  # the scratch is sized by it
        out = q.new_empty(total, heads, d)
        lse = q.new_empty(heads, total)
        ctx.extra = (
            longest,
            scale,
            -1 if window == float("inf") else math.ceil(window),
        )  # keys i - j < window
        _run("forward", (q, k, v), cu, ctx.extra, _strides(q, k, v, out), (out, lse))
        ctx.save_for_backward(q, k, v, out, lse, cu)
        return out.view(1, total, heads * d)

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dout = g.reshape(out.shape).contiguous()
        dq, dk = q.new_empty(q.shape), k.new_empty(k.shape)
        dv = v.new_empty(v.shape[2], v.shape[1], v.shape[3])  # (total, KV, D): as v_proj's output lies
        strides = _strides(q, k, v, out, dq, dk, dv)
        _run("backward", (q, k, v, out, dout, lse), cu, ctx.extra, strides, (dq, dk, dv))
        return dq, dk, dv.transpose(0, 1).unsqueeze(0), None, None, None, None


def _run(direction: str, inputs, cu, extra, strides: list[int], outputs) -> None:
    """``gpufleet_attention_<direction>`` on these tensors, with each thread's scratch."""
    lib = cpu_kernels.library()
    longest, scale, window = extra
    q, k = inputs[0], inputs[1]
    heads, d, threads = q.shape[1], q.shape[3], torch.get_num_threads()
    scratch = q.new_empty(threads * lib.gpufleet_attention_scratch(d, longest))
    st = torch.tensor(strides, dtype=torch.long)
    getattr(lib, f"gpufleet_attention_{direction}")(
        *(t.data_ptr() for t in inputs[:3]),
        *(t.data_ptr() for t in inputs[3:] if direction == "backward"),
        cu.data_ptr(),
        len(cu) - 1,
        heads,
        k.shape[1],
        d,
        st.data_ptr(),
        scale,
        window,
        *(t.data_ptr() for t in outputs),
        longest,
        scratch.data_ptr(),
        threads,
    )


def packed_mask(cu_seq_lens: torch.Tensor, tokens: int, window: float) -> torch.Tensor:
    """The (1, 1, total, total) boolean mask of a packed row: each token sees its own sequence's tokens up
    to itself, the last ``window`` of them (for a module's own forward, where ``packed_attention`` does
    not run)."""
    lengths = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    device = cu_seq_lens.device
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    position = torch.arange(tokens, device=device)
    back = position[:, None] - position[None, :]  # how far back each key is from each query
    visible = (sequence[:, None] == sequence[None, :]) & (back >= 0) & (back < window)
    return visible[None, None]


def window_of(module: torch.nn.Module) -> float:
    """The keys a query of ``module`` sees at most, as its model chooses the layer's mask (transformers
    5.23): by ``config.layer_types`` where the config has them (Qwen2 / Qwen3 / Qwen2-MoE: the config's
    window on "sliding_attention" layers only; Qwen2-MoE's config holds 0 there when no layer slides),
    else the config's window for every layer (Mistral, Qwen3-MoE; Llama: none); infinity for none."""
    config = module.config
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and isinstance(getattr(module, "layer_idx", None), int):
        window = config.sliding_window if types[module.layer_idx] == "sliding_attention" else None
    else:
        window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
    return float("inf") if window is None else window
