"""The CPU decode loop with its bookkeeping in C (engine/nativeloop.py): the rollout of the torch loop over the
same fast decoder, bit for bit, and where it steps aside."""

from __future__ import annotations

import pytest

from gpufleet.engine import cpu_kernels, nativeloop, rollout
from gpufleet.engine.fastdecode import FastDecoder
from gpufleet.engine.rollout import generate
from gpufleet.models.builtin import PAD_TOKEN_ID
from test_fastdecode import assert_same_rollout, models, random_prompts, rows_finishing_early, sample  # noqa: F401

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))


def _both(model, prompts, monkeypatch, **kw):
    """(native loop, torch loop) rollouts of the fast decoder, checking which loop ran."""
    ran = []
    decode = nativeloop.decode
    monkeypatch.setattr(nativeloop, "decode", lambda *a: ran.append(1) or decode(*a))
    native = sample(model, prompts, monkeypatch, fast=True, **kw)
    assert ran, "the native loop did not run"
    monkeypatch.setattr(nativeloop, "applies", lambda *a: False)
    ran.clear()
    torch_loop = sample(model, prompts, monkeypatch, fast=True, **kw)
    assert not ran
    monkeypatch.undo()
    return native, torch_loop


@pytest.mark.parametrize("name", ["tiny-qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "suppress_tokens": (0,), "min_new_tokens": 5},
    ],
    ids=["sampled", "suppressed-min-new"],
)
def test_native_loop_gives_the_torch_loops_rollout(models, monkeypatch, name, kw):  # noqa: F811
    model = models[name]
    groups = [p for p in random_prompts(3, seed=4, lo=2, hi=9) for _ in range(3)]
    for prompts in (random_prompts(6, seed=1, lo=1, hi=12), groups):
        native, torch_loop = _both(model, prompts, monkeypatch, **kw)
        assert_same_rollout(native, torch_loop)


def test_native_loop_drops_finished_rows_and_stops_when_all_are_done(models, monkeypatch):  # noqa: F811
    model = models["tiny-qwen2"]
    prompts, kw = rows_finishing_early(model, monkeypatch)
    kept: list[int] = []
    keep = FastDecoder.keep
    for fraction in (0.25, 0.05):
        monkeypatch.setattr(
            FastDecoder, "keep", lambda self, rows: kept.append(len(rows)) or keep(self, rows)
        )
        monkeypatch.setattr(rollout, "_DROP_FRACTION", fraction)
        native, torch_loop = _both(model, prompts, monkeypatch, **kw)
        assert_same_rollout(native, torch_loop)
        assert 0 < int(native.is_truncated.sum()) < len(prompts)
    assert len(kept) >= 2 and min(kept) < len(prompts)  # rows left the decoder, in both loops
    # the rows that pick EOS within 200 tokens, alone: the loop ends when the last one does
    kw = kw | {"max_new_tokens": 200, "pad_token_id": PAD_TOKEN_ID}
    seeds = [100 + i for i in range(len(prompts))]
    probe = generate(model, prompts, seeds=seeds, **kw)
    rows = [i for i in range(len(prompts)) if not probe.is_truncated[i]]
    assert len(rows) >= 2
    prompts, seeds = [prompts[i] for i in rows], [seeds[i] for i in rows]
    native = generate(model, prompts, seeds=seeds, **kw)
    monkeypatch.setattr(nativeloop, "applies", lambda *a: False)
    assert_same_rollout(native, generate(model, prompts, seeds=seeds, **kw))
    assert native.completion_ids.shape[1] < 200 and not bool(native.is_truncated.any())


def test_other_sampling_and_collectives_take_the_torch_loop(models, monkeypatch):  # noqa: F811
    model = models["tiny-qwen2"]
    decoder = FastDecoder(model, check=False)
    assert nativeloop.applies(decoder, 1.0, 1.0, 0, None)
    assert not nativeloop.applies(None, 1.0, 1.0, 0, None)
    assert not nativeloop.applies(decoder, 0.0, 1.0, 0, None)  # greedy
    assert not nativeloop.applies(decoder, 1.0, 0.9, 0, None)  # top-p
    assert not nativeloop.applies(decoder, 1.0, 1.0, 5, None)  # top-k
    assert not nativeloop.applies(decoder, 1.0, 1.0, 0, lambda done: done)  # FSDP's all_done
