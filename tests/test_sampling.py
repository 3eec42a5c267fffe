"""engine/sampling.py by hand: which tokens are never sampled, and what suppressing them does to the logits."""

from __future__ import annotations

import math

import pytest
import torch

from gpufleet.engine import cpu_kernels
from gpufleet.engine.sampling import (
    cumulative,
    never_sampled,
    next_tokens,
    pick,
    suppress_early,
    suppress_logits,
)


def test_never_sampled_is_a_pad_that_is_no_eos():
    assert never_sampled(0, [1]) == (0,)  # the built-in models: <pad> 0, <eos> 1
    assert never_sampled(0, [1, None, [1, 7]]) == (0,)
    assert never_sampled(7, [1, [2, 7]]) == ()  # pad is one of the generation config's EOS ids
    assert never_sampled(1, [1]) == ()  # pad = eos (GPT-2 / Llama style): nothing to leave out
    assert never_sampled(None, [1]) == ()
    assert never_sampled(5, []) == (5,)


def test_suppressed_logits_give_probability_zero_and_a_finite_entropy():
    logits = torch.tensor([[2.0, 0.0, math.log(3.0)], [1.0, 1.0, 1.0]])
    out = suppress_logits(logits, (0,))
    assert out[0, 1:].tolist() == logits[0, 1:].tolist() and out[0, 0] == torch.finfo(torch.float32).min
    probs = torch.softmax(out, dim=-1)
    # [_, e^0, e^ln3] / 4 = [0, 1/4, 3/4]; [_, 1, 1] / 2
    assert torch.allclose(probs, torch.tensor([[0.0, 0.25, 0.75], [0.0, 0.5, 0.5]]))
    assert probs[:, 0].tolist() == [0.0, 0.0]
    log_z = torch.logsumexp(out, dim=-1)
    entropy = log_z - (probs * out).sum(dim=-1)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(entropy, torch.tensor([expected, math.log(2)]))
    assert suppress_logits(logits, ()) is logits


def test_suppressed_logits_carry_no_gradient_to_the_token():
    logits = torch.randn(2, 5, requires_grad=True)
    torch.log_softmax(suppress_logits(logits, (3,)), dim=-1)[:, 1].sum().backward()
    assert logits.grad[:, 3].tolist() == [0.0, 0.0] and (logits.grad[:, 1] != 0).all()


def test_a_suppressed_token_is_never_picked_greedy_or_sampled():
    logits = torch.tensor([[5.0, 0.0, 0.1], [5.0, 0.2, 0.0]])
    assert next_tokens(suppress_logits(logits, (0,)), None, 0.0, 1.0, 0).tolist() == [2, 1]
    uniforms = torch.tensor([0.0, 1 - 2**-24]).double()  # the lowest and the highest draw
    for temperature in (0.5, 1.0, 2.0):
        picked = next_tokens(suppress_logits(logits, (0,)), uniforms, temperature, 1.0, 0)
        assert picked.tolist() == [1, 2]


def test_suppress_early_removes_eos_only_before_the_minimum():
    logits = torch.zeros(2, 5, 4)  # completion positions 3..7 of a chunk
    out = suppress_early(logits, 1, first=3, count=5)  # EOS (id 1) barred at positions 3 and 4
    probs = torch.softmax(out, dim=-1)
    assert probs[:, :2, 1].eq(0).all() and probs[:, 2:, 1].eq(0.25).all()
    assert probs[:, :2, 0].allclose(torch.tensor(1 / 3))
    assert suppress_early(logits, 1, first=5, count=5) is logits  # a chunk past the minimum
    assert suppress_early(logits, None, first=0, count=5) is logits  # no EOS


@pytest.mark.parametrize("vocab", [5000, 4096 * 2 + 7, 151_936])
def test_the_chunked_scan_gives_the_cumulative_sums_and_the_same_tokens(vocab):
    """The GPU's chunked scan (run here on the CPU): the cumulative sums to float64 rounding, padding
    columns that repeat the total, and the tokens the plain scan picks (a suppressed token never)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn((16, vocab), generator=gen) * 3
    logits[:, 1024] = torch.finfo(torch.float32).min  # probability 0 at a chunk's first column
    probs = torch.softmax(logits, dim=-1)
    plain, chunked = cumulative(probs, chunked=False), cumulative(probs, chunked=True)
    assert chunked.shape[1] == -(-vocab // 1024) * 1024 and chunked.dtype == torch.float64
    assert torch.allclose(chunked[:, :vocab], plain, rtol=0, atol=1e-13)
    assert torch.equal(chunked[:, vocab:], chunked[:, -1:].expand(-1, chunked.shape[1] - vocab))
    u = torch.rand((16, 4096), generator=gen, dtype=torch.float64)
    picks = []
    for cdf in (plain, chunked):
        target = u * cdf[:, -1:]
        picks.append(torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1))
    assert torch.equal(picks[0], picks[1]) and not bool((picks[1] == 1024).any())


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here")
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3, 0.05])
@pytest.mark.parametrize("vocab", [90, 5000])
def test_pick_in_c_gives_the_tokens_of_the_torch_ops(temperature, vocab):
    """The C steps around the softmax (suppress, temperature, float64 running sum, search) against
    suppress_logits + next_tokens: the same token for every row and draw, the suppressed never."""
    gen = torch.Generator().manual_seed(vocab)
    suppress = torch.tensor([0, 3, vocab - 1])
    for trial in range(40):
        logits = torch.randn((16, vocab), generator=gen) * (1 + trial % 4)
        uniforms = torch.rand((16, 8), generator=gen).double()
        uniforms[0, 3], uniforms[1, 3] = 0.0, 1 - 2**-24  # the lowest and the highest draw
        expected = next_tokens(suppress_logits(logits, suppress), uniforms[:, 3], temperature, 1.0, 0)
        got = pick(logits.clone(), suppress, uniforms[:, 3], temperature, 1.0, 0)
        assert torch.equal(got, expected), trial
        assert not bool(torch.isin(got, suppress).any())


def test_pick_takes_the_torch_ops_for_top_k_top_p_greedy_and_other_dtypes():
    gen = torch.Generator().manual_seed(1)
    logits, uniforms = torch.randn((8, 300), generator=gen), torch.rand(8, generator=gen).double()
    none = torch.tensor([], dtype=torch.long)
    for settings in ((0.0, 1.0, 0), (1.0, 0.9, 0), (0.8, 1.0, 20), (0.8, 0.5, 7)):
        assert torch.equal(
            pick(logits.clone(), none, uniforms, *settings), next_tokens(logits, uniforms, *settings)
        )
    half = logits.bfloat16()
    assert torch.equal(
        pick(half.clone(), none, uniforms, 1.0, 1.0, 0), next_tokens(half, uniforms, 1.0, 1.0, 0)
    )
