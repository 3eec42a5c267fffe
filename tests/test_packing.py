"""A micro-batch's sequences packed into one row for the CPU training forward (engine/packing.py): the layout
by hand, and log-probs, entropies and gradients equal to the padded forward's (and to Hugging Face's own
attention over the packed row). The attention kernel itself: test_packedattention.py."""

from __future__ import annotations

import pytest
import torch

from gpufleet.engine import fusedlayers, packing
from gpufleet.engine.logprobs import sequence_logprobs
from test_fastdecode import CONFIGS, VOCAB
from test_fusedlayers import _model


def test_the_layout_by_hand():
    ids = torch.tensor(
        [
            [0, 11, 12, 21, 22, 23],  # a left-padded prompt of 2, a completion of 3
            [13, 14, 15, 24, 0, 0],  # a prompt of 3, a completion of 1 (then padding)
            [0, 0, 16, 0, 0, 0],  # a prompt of 1, no completion token attended
        ]
    )
    mask = (ids > 0).long()
    p = packing.pack(ids, mask, 3)
    assert p.input_ids.tolist() == [[11, 12, 21, 22, 23, 13, 14, 15, 24, 16]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]]
    assert p.cu_seq_lens.tolist() == [0, 5, 9, 10] and p.cu_seq_lens.dtype == torch.int32
    assert p.max_length == 5
    # row 0 predicts its 3 completion tokens from packed positions 1, 2, 3; row 1 its one from 7
    assert p.kept.tolist() == [1, 2, 3, 7]
    assert p.targets.tolist() == [[21, 22, 23, 24]]
    assert p.where.tolist() == [0, 1, 2, 3]  # rows x 3 columns: (0, 0), (0, 1), (0, 2), (1, 0)
    out = packing.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0]), p, 3, 3)
    assert out.tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]


def test_rows_that_do_not_pack():
    ids = torch.arange(1, 13).view(2, 6)
    gap = torch.ones_like(ids)
    gap[1, 4] = 0  # a hole inside the completion: two runs
    assert packing.pack(ids, gap, 3) is None
    no_prompt = torch.ones_like(ids)
    no_prompt[0, :3] = 0  # nothing to predict the first completion token from
    assert packing.pack(ids, no_prompt, 3) is None
    assert packing.pack(ids, torch.ones_like(ids), 3) is not None
    prompts_only = torch.ones_like(ids)
    prompts_only[:, 3:] = 0  # no completion token attended in any row: nothing to predict
    assert packing.pack(ids, prompts_only, 3) is None


def _batch(seed: int = 0):
    """Six rows: prompts of 1-4 tokens left-padded to 4, completions of 1-8 tokens right-padded to 8."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (6, 12), generator=g)
    mask = torch.ones_like(ids)
    for row, (prompt, completion) in enumerate([(4, 8), (1, 3), (2, 8), (3, 1), (4, 5), (1, 2)]):
        mask[row, : 4 - prompt] = 0
        mask[row, 4 + completion :] = 0
    return ids, mask


def _run(model, ids, mask, packed: bool, monkeypatch, **kw):
    monkeypatch.setenv("GPUFLEET_PACKED", "1" if packed else "0")
    model.zero_grad(set_to_none=True)
    logp, entropy = sequence_logprobs(model, ids, mask, 4, **kw)
    keep = mask[:, 4:].float()
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(logp.shape, generator=g)
    ((logp * weights * keep).sum() + 0.1 * (entropy * keep).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach() * keep, entropy.detach() * keep, grads


def _moe(kind: str):
    """Qwen2-MoE (its config's sliding window 0 where no layer slides) and Qwen3-MoE, 4 experts of 32."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    from test_fastdecode import _COMMON

    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_key_value_heads": 2}
    config = (
        Qwen2MoeConfig(**_COMMON, **moe, shared_expert_intermediate_size=48)
        if kind == "qwen2-moe"
        else Qwen3MoeConfig(**_COMMON, **moe)
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize(
    "kind",
    ["qwen3", "mistral", "llama-bias-llama3-rope", "qwen2-wide-sliding-window", "qwen2-moe", "qwen3-moe"],
)
def test_packed_forward_equals_the_padded_one(kind, monkeypatch):
    model = _moe(kind) if kind.endswith("moe") else _model(kind)
    ids, mask = _batch()
    kw = {"temperature": 0.7, "suppress_tokens": (0,)}
    calls = []
    counted = fusedlayers.packed_attention
    monkeypatch.setattr(fusedlayers, "packed_attention", lambda *a: calls.append(a[4]) or counted(*a))
    packed = _run(model, ids, mask, True, monkeypatch, **kw)
    assert len(calls) == 2 and set(calls) == {12}  # both layers within the sequences (the longest: 12)
    calls.clear()
    padded = _run(model, ids, mask, False, monkeypatch, **kw)
    assert not calls
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(packed[1], padded[1], rtol=0, atol=2e-6)
    for name, grad in packed[2].items():
        torch.testing.assert_close(
            grad, padded[2][name], rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_packed_without_entropy_the_same_logprobs(monkeypatch):
    monkeypatch.setenv("GPUFLEET_PACKED", "1")
    model = _model("qwen3")
    calls = []
    counted = fusedlayers.packed_attention
    monkeypatch.setattr(fusedlayers, "packed_attention", lambda *a: calls.append(a[4]) or counted(*a))
    with torch.no_grad():
        logp, entropy = sequence_logprobs(model, *_batch(), 4, temperature=0.7)
        alone, none = sequence_logprobs(model, *_batch(), 4, temperature=0.7, entropy=False)
    assert len(calls) == 4 and entropy.shape == (6, 8)  # packed both times
    assert none is None and torch.equal(alone, logp)


@pytest.mark.parametrize("window", [None, 3])
def test_the_mask_is_the_one_hugging_face_builds_for_packed_positions(window):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = CONFIGS["qwen2-wide-sliding-window"]()
    config.sliding_window = window
    config._attn_implementation = "sdpa"
    p = packing.pack(*_batch(), 4)
    total = p.input_ids.shape[1]
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    theirs = make(
        config=config,
        inputs_embeds=torch.zeros(1, total, 8),
        attention_mask=None,
        past_key_values=None,
        position_ids=p.position_ids,
    )
    ours = fusedlayers.packed_mask(p.cu_seq_lens, total, float("inf") if window is None else window)
    assert torch.equal(ours, theirs.expand_as(ours))


def test_a_modules_own_forward_over_the_packed_row(monkeypatch):
    """Where the fused attention does not run (here: eager attention), a packed row still attends within
    its sequences (``fusedlayers.packed_mask``)."""
    model = _model("qwen3")
    p = packing.pack(*_batch(1), 4)
    with torch.no_grad():
        fused = _kept_logits(model, p)
        model.config._attn_implementation = "eager"
        own = _kept_logits(model, p)
    torch.testing.assert_close(fused, own, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2-wide-sliding-window", "mistral"])
def test_a_sliding_window_shorter_than_the_rows(kind, monkeypatch):
    model = _model(kind)
    model.config.sliding_window = 3
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 3
    ids, mask = _batch()
    calls = []
    counted = fusedlayers.packed_attention
    monkeypatch.setattr(fusedlayers, "packed_attention", lambda *a: calls.append(a[6]) or counted(*a))
    packed = _run(model, ids, mask, True, monkeypatch)
    # Qwen2: layer 1 slides (max_window_layers 1), layer 0 does not; Mistral: every layer slides
    assert calls == ([float("inf"), 3] if kind.startswith("qwen2") else [3, 3])
    padded = _run(model, ids, mask, False, monkeypatch)
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=2e-6)
    for name, grad in packed[2].items():
        torch.testing.assert_close(grad, padded[2][name], rtol=1e-4, atol=2e-6)


def _kept_logits(model, p: packing.Packed) -> torch.Tensor:
    with fusedlayers.fused_layers(model):
        return model(**p.forward_kwargs()).logits


def test_where_the_rows_are_not_packed(monkeypatch):
    model = _model("qwen3")
    assert packing.applies(model, None, 0) and packing.applies(model, 2, 0)
    assert not packing.applies(model, 2, 3)  # EOS held back early: counted per row, in the padded forward
    assert not packing.applies(_model("qwen3", torch.float64), None, 0)  # the fused layers do not run
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not packing.applies(model, None, 0)
    eager = _model("qwen3")
    eager.config._attn_implementation = "eager"
    assert not packing.applies(eager, None, 0)
    routed = _moe("qwen2-moe")
    assert packing.applies(routed, None, 0)
    routed.config.output_router_logits = True  # the load-balancing loss reads the attention mask
    assert not packing.applies(routed, None, 0)
    monkeypatch.setenv("GPUFLEET_PACKED", "0")
    assert not packing.applies(model, None, 0)
    monkeypatch.setenv("GPUFLEET_PACKED", "1")
    monkeypatch.setenv("GPUFLEET_FUSED_LOGPROBS", "0")
    assert not packing.applies(model, None, 0)


def test_min_new_tokens_takes_the_padded_forward(monkeypatch):
    model = _model("qwen3")
    ids, mask = _batch()
    seen = []
    monkeypatch.setattr(packing, "pack", lambda *a: seen.append(1))
    with torch.no_grad():
        sequence_logprobs(model, ids, mask, 4, eos_token_id=2, min_new_tokens=3)
        assert not seen
        sequence_logprobs(model, ids, mask, 4, eos_token_id=2)
    assert seen  # then packed (here: pack says no, and the padded forward runs)


def test_packed_only_where_it_saves_more_than_pack_over(monkeypatch):
    from gpufleet.rl import batch as batch_module

    model = _model("qwen3")
    ids, mask = _batch()  # 72 positions, 42 of them attended: packing saves 30
    calls = []
    counted = fusedlayers.packed_attention
    monkeypatch.setattr(fusedlayers, "packed_attention", lambda *a: calls.append(1) or counted(*a))
    with torch.no_grad():
        sequence_logprobs(model, ids, mask, 4, pack_over=29)
        assert calls
        calls.clear()
        sequence_logprobs(model, ids, mask, 4, pack_over=30)
        sequence_logprobs(model, ids, mask, 4, pack_over=None)
    assert not calls
    cost = batch_module.pass_tokens(model)
    assert batch_module.pack_over(model) == int(cost * batch_module.PACK_SHARE)
    assert batch_module.pack_over(torch.nn.Linear(4, 4)) is None  # no pass cost known: never packed


@pytest.mark.parametrize("micro", [8, 3])
def test_a_training_step_packed_equals_the_padded_one(tmp_path, monkeypatch, micro):
    """The trainer's optimizer step (policy log-probs, the reference's, the loss) with every micro-batch
    packed, against the same step with the rows padded and cut by length."""
    from gpufleet.rl import batch as batch_module
    from gpufleet.rl import trainer
    from test_trainer import grads_for, make_job

    job = make_job(tmp_path, "algorithm.beta=0.1", "rollout.max_completion_length=16")
    parts = trainer.build(job)
    scored = trainer.generation_step(parts, 0, trainer.autocast_for(job, parts.device))
    assert len(set(scored.batch.completion_lengths())) > 2  # completions of different lengths
    monkeypatch.setattr(batch_module, "PACK_SHARE", 0.0)  # pack whatever padding it saves
    calls = []
    counted = fusedlayers.packed_attention
    monkeypatch.setattr(fusedlayers, "packed_attention", lambda *a: calls.append(1) or counted(*a))
    ref = batch_module.logprobs_of(
        parts.reference, scored.batch, 1.0, micro, trainer.autocast_for(job, parts.device)
    )
    packed = grads_for(job, scored, parts, micro)
    assert calls
    monkeypatch.setenv("GPUFLEET_PACKED", "0")
    calls.clear()
    padded_ref = batch_module.logprobs_of(
        parts.reference, scored.batch, 1.0, micro, trainer.autocast_for(job, parts.device)
    )
    padded = grads_for(job, scored, parts, micro)
    assert not calls
    mask = scored.batch.completion_mask.bool()
    torch.testing.assert_close(ref[mask], padded_ref[mask], rtol=0, atol=2e-6)
    for a, b in zip(packed, padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)
