"""``generate(..., logprobs=True)`` records each sampled token's log-prob while decoding
(``Rollout.logprobs``): the values a no-grad forward over the completions gives (the trainer's
``logprobs_of``, what a rollout rank sent before), on every decode path: the C decode loop, the torch loop
of the fast decoder (top-k), the Hugging Face forward; with suppressed tokens, EOS held back before
``min_new_tokens`` and a temperature."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from gpufleet.engine.rollout import FAST_DECODE_ENV, Sampling
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import EOS_TOKEN_ID, PAD_TOKEN_ID, materialize
from gpufleet.rl.batch import GenerationBatch, logprobs_of


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(str(materialize("tiny-qwen2"))).eval()


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10], [12, 13, 14]]


@pytest.mark.parametrize(
    "path, settings",
    [
        ("native", {"temperature": 1.0}),
        ("native", {"temperature": 0.7, "suppress_tokens": (PAD_TOKEN_ID,), "min_new_tokens": 4}),
        ("torch", {"temperature": 0.9, "top_k": 20, "suppress_tokens": (PAD_TOKEN_ID,), "min_new_tokens": 3}),
        ("hf", {"temperature": 1.3, "suppress_tokens": (PAD_TOKEN_ID,), "min_new_tokens": 2}),
    ],
)
def test_the_recorded_logprobs_are_the_forwards(model, monkeypatch, path, settings):
    if path == "hf":
        monkeypatch.setenv(FAST_DECODE_ENV, "0")
    sampling = Sampling(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, **settings)
    out = sampling.generate(model, PROMPTS, [1, 2, 3, 4, 5], 16, logprobs=True)
    assert out.logprobs is not None and out.logprobs.shape == out.completion_ids.shape
    empty = torch.zeros(0)
    batch = GenerationBatch(out.input_ids, out.attention_mask, empty, empty, None, None, out.completion_start)
    early = (EOS_TOKEN_ID, sampling.min_new_tokens)
    with torch.no_grad():
        ref = logprobs_of(model, batch, sampling.temperature, 8, nullcontext, sampling.suppress_tokens, early)
    live = out.completion_mask.bool()
    assert float((out.logprobs - ref[:, : out.logprobs.shape[1]])[live].abs().max()) < 1e-5
    assert bool((out.logprobs[live] < 0).all()) and bool(out.logprobs.isfinite().all())  # pads too
    again = sampling.generate(model, PROMPTS, [1, 2, 3, 4, 5], 16)  # recording changes no token
    assert again.logprobs is None and torch.equal(again.completion_ids, out.completion_ids)
    part = out.rows(1, 3)
    assert torch.equal(part.logprobs, out.logprobs[1:3, : part.completion_ids.shape[1]])
