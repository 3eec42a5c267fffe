"""Causal attention within each sequence of a packed row (engine/packedattention.py, attention_kernels.c),
forward and backward, against each sequence on its own through SDPA in float64: grouped heads, head widths
that are and are not a multiple of the kernel's 16-column tiles, sequences longer than its 48-row chunks,
a sliding window, one-token sequences; the same bits whatever the thread count."""

from __future__ import annotations

import pytest
import torch

from gpufleet.engine import cpu_kernels
from gpufleet.engine.packedattention import packed_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C kernels here")


def _per_sequence(q, k, v, lengths, scale, window):
    """Each sequence on its own through SDPA in float64 (the key/value heads repeated as repeat_kv does,
    a sliding window as Hugging Face's mask: key j seen by query i where 0 <= i - j < window)."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        s = slice(start, start + n)
        t = torch.arange(n)
        back = t[:, None] - t[None, :]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s].double(),
            k[:, :, s].double().repeat_interleave(rep, 1),
            v[:, :, s].double().repeat_interleave(rep, 1),
            attn_mask=(back >= 0) & (back < window),
            scale=scale,
        )
        outs.append(o.transpose(1, 2).reshape(1, n, -1))
        start += n
    return torch.cat(outs, dim=1)


def _inputs(heads, kv_heads, d, lengths, seed=0):
    """q (1, H, total, D) contiguous, k (1, KV, total, D) contiguous and v a transposed view of
    (1, total, KV, D), as the fused attention module has them; the leaves to take gradients of."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, d, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, total, d, generator=g, requires_grad=True)
    v_rows = torch.randn(1, total, kv_heads, d, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gout = torch.randn(1, total, heads * d, generator=g)
    return q, k, v_rows, cu, gout


CASES = [
    # heads, kv heads, head width, sequence lengths, window
    (4, 1, 8, [5, 1, 9, 3], float("inf")),
    (4, 2, 8, [5, 1, 9, 3], float("inf")),
    (4, 4, 8, [5, 1, 9, 3], 3),
    (4, 2, 64, [66, 50, 1, 13], float("inf")),  # the `small` benchmark's shape
    (4, 4, 72, [100, 130, 49, 48, 47], float("inf")),  # several chunks; 72 = 4 tiles and a part
    (6, 2, 128, [200, 3], float("inf")),
    (4, 1, 64, [70, 20, 90], 16),  # a window shorter than most sequences
    (2, 2, 80, [97], 50),
    (4, 2, 8, [5, 1, 9, 3], 2.5),  # keys j where i - j < 2.5: three
]


@pytest.mark.parametrize(("heads", "kv_heads", "d", "lengths", "window"), CASES)
def test_equals_each_sequence_on_its_own(heads, kv_heads, d, lengths, window):
    q, k, v_rows, cu, gout = _inputs(heads, kv_heads, d, lengths)
    v = v_rows.transpose(1, 2)
    scale = d**-0.5
    ours = packed_attention(q, k, v, cu, max(lengths), scale, window)
    assert ours.shape == (1, sum(lengths), heads * d) and ours.dtype == torch.float32
    grads = torch.autograd.grad(ours, (q, k, v_rows), gout)
    want = _per_sequence(q, k, v, lengths, scale, window)
    want_grads = torch.autograd.grad(want, (q, k, v_rows), gout.double())
    torch.testing.assert_close(ours.double(), want, rtol=0, atol=3e-6)
    for ours_grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(ours_grad, want_grad, rtol=0, atol=1e-5)


def test_the_same_bits_whatever_the_thread_count():
    q, k, v_rows, cu, gout = _inputs(4, 2, 64, [66, 50, 1, 13, 80], seed=1)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = packed_attention(q, k, v_rows.transpose(1, 2), cu, 80, 0.125)
            results.append((out, *torch.autograd.grad(out, (q, k, v_rows), gout)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_a_sequence_does_not_see_the_next_one():
    """Changing one sequence's keys and values changes no other sequence's output or query gradients."""
    q, k, v_rows, cu, gout = _inputs(4, 2, 16, [7, 60, 5])
    base = packed_attention(q, k, v_rows.transpose(1, 2), cu, 60, 0.25)
    k2, v2 = k.detach().clone(), v_rows.detach().clone()
    k2[:, :, 7:67] += 1.0
    v2[:, 7:67] -= 2.0
    other = packed_attention(q, k2, v2.transpose(1, 2), cu, 60, 0.25)
    assert torch.equal(base[:, :7], other[:, :7]) and torch.equal(base[:, 67:], other[:, 67:])
    assert not torch.allclose(base[:, 7:67], other[:, 7:67])


def test_what_is_not_one_packed_row_is_refused():
    q, k, v_rows, cu, _ = _inputs(4, 2, 8, [5, 3])
    v = v_rows.transpose(1, 2)
    for bad_cu in ([0, 5, 7], [0, 5, 9], [1, 5, 8], [0, 6, 5, 8]):
        with pytest.raises(ValueError, match="not one packed row"):
            packed_attention(q, k, v, torch.tensor(bad_cu, dtype=torch.int32), 5, 0.3)
    with pytest.raises(ValueError, match="not one packed row"):
        packed_attention(q[:, :3], k, v, cu, 5, 0.3)  # 3 query heads over 2 key/value heads
    with pytest.raises(ValueError, match="not one packed row"):
        packed_attention(q, k, v, cu, 5, 0.3, 0)
    with pytest.raises(ValueError, match="float32 CPU"):
        packed_attention(q.double(), k.double(), v.double(), cu, 5, 0.3)
