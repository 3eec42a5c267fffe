"""Attention within each sequence of a packed row (rl/packing.py), for the fused CPU attention
(``fusedlayers.attention``): one SDPA call over the rows laid out side by side, the mask of a packed row
for a module's own forward, and the sliding window a layer has as its model chooses it."""

from __future__ import annotations

import torch

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
    (rl/packing.py), each query seeing its last ``window`` keys at most: q (1, H, total, D), k and v
    (1, KV heads, total, D) -> (1, total, H x D). The sequences are laid out as (B, longest) rows for
    one SDPA call, each row's tail filled with copies of its last token: a causal query never sees the
    keys after it, and the filler's outputs are dropped (their gradients are zero). Every row starts at
    position 0, so a window shorter than ``longest`` is one (longest x longest) band for all rows."""
    lengths = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    t = torch.arange(longest, device=q.device)
    index = cu_seq_lens[:-1, None].long() + torch.minimum(t, lengths[:, None] - 1)  # (B, longest)
    rows = index.shape[0]

    def padded(x: torch.Tensor) -> torch.Tensor:  # (1, heads, total, D) -> (B, heads, longest, D)
        heads, d = x.shape[1], x.shape[3]
        return (
            x[0]
            .transpose(0, 1)
            .index_select(0, index.flatten())
            .view(rows, longest, heads, d)
            .transpose(1, 2)
        )

    band = None
    if window < longest:  # key j visible to query i where 0 <= i - j < window (HF's sliding window)
        back = t[:, None] - t[None, :]
        band = (back >= 0) & (back < window)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded(q),
        padded(k),
        padded(v),
        attn_mask=band,
        scale=scale,
        is_causal=band is None and longest > 1,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    real = (t < lengths[:, None]).flatten().nonzero().squeeze(1)  # row by row: the packed order
    return out.transpose(1, 2).reshape(index.numel(), -1).index_select(0, real).unsqueeze(0)


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
