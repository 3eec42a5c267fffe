"""Micro-batches by completion length (rl/batch.py): which rows go together, how far each is cut, and
that log-probs and gradients are those of the whole padded batch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.rl import batch as batch_module
from gpufleet.rl import trainer
from gpufleet.rl.batch import GenerationBatch, length_groups, logprobs_of
from test_trainer import grads_for, make_job


def test_length_groups_by_hand():
    # rows longest first, stable: 1, 2 (64), 0 (3), 3 (1); fixed (prompt) 8 tokens per row
    assert length_groups([3, 64, 64, 1], 4, 8, None) == [[1, 2, 0, 3]]
    assert length_groups([3, 64, 64, 1], 2, 8, None) == [[1, 2], [0, 3]]
    # whole: 4 x 72 = 288; cut after 1 row: 72 + 3 x 72 + 64 = 352; after 2: 144 + 2 x 11 + 64 = 230
    # (the best); after 3: 216 + 9 + 64 = 289. The parts: 144 < 72 + 72 + 64, 22 < 11 + 9 + 64: kept.
    assert length_groups([3, 64, 64, 1], 4, 8, 64) == [[1, 2], [0, 3]]
    # one more pass costs more than the 2 x 61 padded tokens it would save
    assert length_groups([3, 64, 64, 1], 4, 8, 200) == [[1, 2, 0, 3]]
    assert length_groups([5, 5, 5, 5], 4, 8, 0) == [[0, 1, 2, 3]]  # nothing to save: never cut
    # cut again inside a part: 10 rows of 64, then 40, 40, 2, 2 -> [64 x 10], [40, 40], [2, 2]
    lengths = [64] * 10 + [40, 40, 2, 2]
    assert length_groups(lengths, 16, 8, 16) == [list(range(10)), [10, 11], [12, 13]]


def _batch(lengths: list[int], prompt: int = 3, width: int = 9) -> GenerationBatch:
    g = torch.Generator().manual_seed(0)
    n = len(lengths)
    ids = torch.randint(3, 60, (n, prompt + width), generator=g)
    attn = torch.ones(n, prompt + width, dtype=torch.long)
    attn[0, :1] = 0  # a left-padded prompt
    for i, n_tokens in enumerate(lengths):
        attn[i, prompt + n_tokens :] = 0
    return GenerationBatch(
        input_ids=ids,
        attention_mask=attn,
        completion_mask=attn[:, prompt:].float(),
        advantages=torch.arange(n, dtype=torch.float32),
        old_logprobs=torch.randn(n, width, generator=g),
        ref_logprobs=None,
        completion_start=prompt,
    )


def test_micro_batches_hold_every_row_once_cut_to_their_longest():
    b = _batch([2, 9, 4, 9, 1])
    assert b.completion_lengths() == [2, 9, 4, 9, 1]
    parts = b.micro_batches(2, None)
    assert [index for index, _ in parts] == [[1, 3], [2, 0], [4]]
    for index, mb in parts:
        width = max(b.completion_lengths()[i] for i in index)
        assert mb.input_ids.shape == (len(index), 3 + width)
        assert torch.equal(mb.input_ids, b.input_ids[index, : 3 + width])
        assert torch.equal(mb.attention_mask, b.attention_mask[index, : 3 + width])
        assert torch.equal(mb.completion_mask, b.completion_mask[index, :width])
        assert torch.equal(mb.old_logprobs, b.old_logprobs[index, :width])
        assert torch.equal(mb.advantages, b.advantages[index]) and mb.ref_logprobs is None


def test_one_more_pass_costs_more_tokens_the_smaller_the_model():
    from gpufleet.models import load_causal_lm
    from gpufleet.models.builtin import materialize

    tiny = load_causal_lm(str(materialize("tiny-qwen2")))  # 2 layers, about 80K weights
    assert batch_module.pass_tokens(tiny) > 1_000  # a batch of tiny sequences is never cut
    small = _model()  # qwen3, 2 layers of 64 wide, a wider vocabulary
    per_layer = sum(p.numel() for p in small.parameters()) / 2
    assert batch_module.pass_tokens(small) == round(batch_module.PASS_FLOPS / (6 * per_layer))
    assert batch_module.pass_tokens(torch.nn.Linear(4, 4)) is None  # no decoder layers: never cut


def _model():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from test_fastdecode import CONFIGS

    return AutoModelForCausalLM.from_config(CONFIGS["qwen3"]()).eval()


@pytest.mark.parametrize("split", [True, False, "packed"])
def test_logprobs_equal_the_whole_padded_batch(split, monkeypatch):
    b = _batch([2, 9, 4, 9, 1, 3])
    model = _model()
    monkeypatch.setattr(batch_module, "PASS_FLOPS", 0 if split else 1e18)
    if split == "packed":  # the rows packed into one forward: no padding to save, never cut
        assert batch_module.length_cut(model, (None, 0)) is None
        split = False
    else:
        monkeypatch.setenv("GPUFLEET_PACKED", "0")
        assert batch_module.length_cut(model, (None, 0)) == batch_module.pass_tokens(model)
    calls, kwargs = [], []
    original = batch_module.sequence_logprobs

    def counted(*a, **k):
        calls.append(a[1].shape)
        kwargs.append(k)
        return original(*a, **k)

    monkeypatch.setattr(batch_module, "sequence_logprobs", counted)
    ours = logprobs_of(model, b, 1.0, 6, contextlib.nullcontext)
    with torch.no_grad():
        whole, _ = sequence_logprobs(model, b.input_ids, b.attention_mask, 3)
    valid = b.completion_mask.bool()
    torch.testing.assert_close(ours[valid], whole[valid], rtol=0, atol=1e-5)
    assert torch.isfinite(ours).all()  # past a row's end: meaningless (the mask), but finite
    assert len(calls) > 1 if split else calls == [(6, 12)]
    assert all(k["entropy"] is False for k in kwargs)  # no-grad passes compute no entropy (as TRL's)


def test_gradients_with_length_cut_micro_batches_equal_one_padded_pass(tmp_path, monkeypatch):
    job = make_job(tmp_path, "algorithm.beta=0.1", "rollout.max_completion_length=16")
    parts = trainer.build(job)
    parts.policy.double()
    parts.reference.double()
    scored = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    lengths = scored.batch.completion_lengths()
    assert len(set(lengths)) > 2, lengths  # completions of different lengths (this seed)
    assert batch_module.length_cut(parts.policy, (None, 0)) is not None  # float64: not packed
    monkeypatch.setattr(batch_module, "PASS_FLOPS", 1e18)  # one pass of all 8 rows, padded
    whole = grads_for(job, scored, parts, 8)
    monkeypatch.setattr(batch_module, "PASS_FLOPS", 0)  # cut wherever padding is saved (1 token a pass)
    assert len(scored.batch.micro_batches(8, batch_module.pass_tokens(parts.policy))) > 1
    cut = grads_for(job, scored, parts, 8)
    for a, b in zip(whole, cut, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
