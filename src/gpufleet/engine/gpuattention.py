"""A decode step's attention on a GPU as two Triton kernels that read only the keys each row holds.

The fast decoder's KV cache is preallocated for the whole rollout, ``(B, kv_heads, capacity, head_dim)``
per layer, and its CUDA graph (``graphdecode``) replays one step for every token, so a step cannot cut
the cache at the current length from the host. ``F.scaled_dot_product_attention`` then reads the
whole cache and a key mask at every step: at 512 of 768 slots written it moves half as many bytes
again as the step needs, and at 64-256 rows the cache is as large as the weights. Here (flash
decoding, split-K):

* ``_partial``: one program per (row, key/value head, split of the cache); it loads the query heads of
  its group once (GQA: each key and value is read once per group, not once per query head), reads its
  split's keys from the row's first real token (``start``, after the left padding) up to the slot being
  written (read from a device tensor, so the graph's replays need no host value), and keeps an online
  softmax (running max, sum and weighted values in float32); given the step's own keys and values, the
  program whose split holds the slot writes them there and attends to them from its registers (the
  step's cache write without two more kernels);
* ``_combine``: per (row, query head), the splits' partial sums rescaled to the common max.

Splits make enough programs for the GPU at few rows (16 rows x 2 key/value heads are 32 programs
for 132 multiprocessors); an empty split (past the current slot) returns at once.

``attend(q, k_cache, v_cache, start, slot, scale)`` is the call; ``usable(device)`` says whether it
runs there (a CUDA device with Triton, unless ``GPUFLEET_DECODE_ATTENTION=0``; with
``TRITON_INTERPRET=1`` on the CPU too, which is how the tests check it against the SDPA it replaces).
"""

from __future__ import annotations

import math
import os

import torch

from gpufleet.engine.switches import switched_off

try:  # Triton comes with torch's CUDA builds; a CPU install may not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = tl = None

__all__ = ["ATTENTION_ENV", "usable", "attend", "plan_splits"]

ATTENTION_ENV = "GPUFLEET_DECODE_ATTENTION"
"""Set to 0 to run the decode step's attention as ``F.scaled_dot_product_attention`` over the whole cache."""

_BLOCK_N = 64
"""Keys per inner iteration of ``_partial``."""


def usable(device: torch.device) -> bool:
    """Whether ``attend`` runs on ``device``: CUDA with Triton (or the Triton interpreter on the CPU)."""
    if triton is None or switched_off(ATTENTION_ENV):
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def plan_splits(rows: int, kv_heads: int, capacity: int, processors: int) -> tuple[int, int]:
    """(splits, keys per split): about two programs per multiprocessor, each split a whole number of
    ``_BLOCK_N`` blocks, at least one block per split.

    >>> plan_splits(16, 2, 768, 132), plan_splits(256, 2, 768, 132), plan_splits(1, 1, 10, 4)
    ((9, 128), (1, 768), (1, 64))
    """
    blocks = math.ceil(capacity / _BLOCK_N)
    splits = max(1, min(blocks, math.ceil(2 * processors / (rows * kv_heads))))
    per_split = math.ceil(blocks / splits) * _BLOCK_N
    return math.ceil(capacity / per_split), per_split


if triton is not None:

    @triton.jit
    def _partial(
        q_ptr, k_ptr, v_ptr, start_ptr, slot_ptr, acc_ptr, stats_ptr, kn_ptr, vn_ptr,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
        scale, per_split, splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        IEEE: tl.constexpr, WRITE: tl.constexpr,
    ):  # fmt: skip
        row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kv_heads = tl.num_programs(1)
        slot = tl.load(slot_ptr)
        lo = tl.maximum(tl.load(start_ptr + row), split * per_split)
        hi = tl.minimum(slot + 1, (split + 1) * per_split)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        k_base = k_ptr + row * stride_kb + head * stride_kh
        v_base = v_ptr + row * stride_vb + head * stride_vh
        if WRITE:  # this step's key and value: the split that holds the slot writes them and uses them
            k_new = tl.load(kn_ptr + row * stride_knb + head * stride_knh + d * stride_knd)
            v_new = tl.load(vn_ptr + row * stride_vnb + head * stride_vnh + d * stride_vnd)
            if (slot >= split * per_split) & (slot < (split + 1) * per_split):
                tl.store(k_base + slot * stride_kt + d, k_new)
                tl.store(v_base + slot * stride_vt + d, v_new)
        q = tl.load(
            q_ptr + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g[:, None] < GROUP,
            other=0.0,
        )
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < hi
            cached = live
            if WRITE:  # the slot's key comes from the registers: this program's store may not be visible yet
                cached = live & (n != slot)
            k = tl.load(k_base + n[:, None] * stride_kt + d[None, :], mask=cached[:, None], other=0.0)
            if WRITE:
                k = tl.where((n == slot)[:, None], k_new[None, :], k)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(live[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * stride_vt + d[None, :], mask=cached[:, None], other=0.0)
            if WRITE:
                v = tl.where((n == slot)[:, None], v_new[None, :], v)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        at = (row * kv_heads + head) * splits + split  # acc (B, KV, S, G, D), stats (B, KV, S, 2, G)
        keep = g < GROUP
        tl.store(acc_ptr + (at * BLOCK_G + g)[:, None] * D + d[None, :], acc, mask=keep[:, None])
        tl.store(stats_ptr + at * 2 * BLOCK_G + g, m, mask=keep)
        tl.store(stats_ptr + at * 2 * BLOCK_G + BLOCK_G + g, total, mask=keep)

    @triton.jit
    def _combine(
        acc_ptr, stats_ptr, out_ptr, splits, heads,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        row, qhead = tl.program_id(0), tl.program_id(1)
        head, member = qhead // GROUP, qhead % GROUP
        kv_heads = heads // GROUP
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D)
        live = s < splits
        at = (row * kv_heads + head) * splits + s
        m = tl.load(stats_ptr + at * 2 * BLOCK_G + member, mask=live, other=float("-inf"))
        total = tl.load(stats_ptr + at * 2 * BLOCK_G + BLOCK_G + member, mask=live, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # an empty split weighs 0
        acc = tl.load(
            acc_ptr + (at * BLOCK_G + member)[:, None] * D + d[None, :], mask=live[:, None], other=0.0
        )
        out = tl.sum(acc * w[:, None], 0) / tl.sum(total * w, 0)
        tl.store(out_ptr + (row * heads + qhead) * D + d, out.to(out_ptr.dtype.element_ty))


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    splits: tuple[int, int] | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one query per row, q (B, H, D), to cached keys ``start[b] .. slot`` of each row
    (``start`` (B,) long: the row's left padding; ``slot`` (1,) long: the slot this step wrote) of
    ``k_cache``/``v_cache`` (B, H_kv, capacity, D), query head h using key/value head h // (H / H_kv)
    -> (B, H * D) in q's dtype. ``splits``: ``plan_splits``'s (splits, keys per split); default from
    the device's multiprocessor count. ``new``: this step's keys and values (B, H_kv, D each, any
    strides), written to ``slot`` by the kernel (the cache write of the step, without two more
    kernels) and attended as written. q may be any view (the compiled RoPE leaves it in the few-row
    matmul's transposed layout): its strides are the kernel's, no copy is made."""
    rows, heads, dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if splits is None:
        processors = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = plan_splits(rows, kv_heads, capacity, processors)
    count, per_split = splits
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows
    k_new, v_new = new if new is not None else (q, q)  # (q: unused pointers when nothing is written)
    acc = torch.empty((rows, kv_heads, count, block_g, dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((rows, kv_heads, count, 2, block_g), dtype=torch.float32, device=q.device)
    out = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    _partial[(rows, kv_heads, count)](
        q, k_cache, v_cache, start, slot, acc, stats, k_new, v_new,
        *q.stride(), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *k_new.stride(), *v_new.stride(),
        scale, per_split, count,
        GROUP=group, BLOCK_G=block_g, BLOCK_N=_BLOCK_N, D=dim, IEEE=q.dtype == torch.float32,
        WRITE=new is not None, num_warps=4,
    )  # fmt: skip
    _combine[(rows, heads)](
        acc, stats, out, count, heads,
        GROUP=group, BLOCK_G=block_g, BLOCK_S=max(2, triton.next_power_of_2(count)), D=dim,
        num_warps=1,
    )  # fmt: skip
    return out.view(rows, heads * dim)
