"""FastDecoder: the logits of the HF forward, the tokens of the HF sampling path, and when it steps aside."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from gpufleet.engine import cpu_kernels, rollout
from gpufleet.engine.fastdecode import FastDecoder
from gpufleet.engine.rollout import generate, left_pad
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import CHAR_VOCAB, EOS_TOKEN_ID, PAD_TOKEN_ID, materialize

VOCAB = len(CHAR_VOCAB)  # the built-in models' vocabulary; the configs below use it too
ATOL = 1e-5

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "max_position_embeddings": 128,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": EOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}

CONFIGS = {
    # q_norm / k_norm, head_dim 32 != hidden / heads, tied embeddings
    "qwen3": lambda: Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    # one key/value head; the default sliding window (4096) is wider than any test sequence
    "mistral": lambda: MistralConfig(**_COMMON, num_key_value_heads=1),
    # no GQA, every bias, llama3 RoPE
    "llama-bias-llama3-rope": lambda: LlamaConfig(
        **_COMMON,
        num_key_value_heads=4,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500000.0,
        },
    ),
    # yarn: attention_scaling != 1
    "qwen2-yarn-rope": lambda: Qwen2Config(
        **_COMMON,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 1e6,
        },
    ),
    "llama-linear-rope": lambda: LlamaConfig(
        **_COMMON, num_key_value_heads=2, rope_parameters={"rope_type": "linear", "factor": 2.0}
    ),
    # a sliding layer whose window (64) holds every test sequence: it restricts nothing
    "qwen2-wide-sliding-window": lambda: Qwen2Config(
        **_COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=64, max_window_layers=1
    ),
}
BUILTIN = ("tiny-qwen2", "tiny-llama", "small-qwen2")


def perturb(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random norm weights and biases (HF initializes them to ones / zeros, which would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model.eval()


def from_config(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return perturb(AutoModelForCausalLM.from_config(config))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastdecode")
    out = {name: perturb(load_causal_lm(str(materialize(name, root=root)))) for name in BUILTIN}
    out |= {name: from_config(make()) for name, make in CONFIGS.items()}
    return out


def random_prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(2, VOCAB) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]


def hf_logits(model, ids, mask, positions, tokens) -> torch.Tensor:
    """(B, 1 + T, V) last-position logits of the HF forward over a DynamicCache, as rollout's HF path."""
    width = ids.shape[1]
    cache = DynamicCache(config=model.config)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
    out = [
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
    ]
    next_pos = mask.sum(dim=1, keepdim=True)
    for t in range(tokens.shape[1]):
        out.append(
            model(
                input_ids=tokens[:, t : t + 1],
                attention_mask=full_mask[:, : width + t + 1],
                position_ids=next_pos + t,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        )
    return torch.stack(out, dim=1)


def fast_logits(model, ids, mask, positions, tokens, **kw) -> torch.Tensor:
    decoder = FastDecoder(model, **kw)
    out = [decoder.prefill(ids, mask, positions, tokens.shape[1])]
    next_pos = mask.sum(dim=1, keepdim=True)
    for t in range(tokens.shape[1]):
        out.append(decoder.step(tokens[:, t], next_pos + t))
    return torch.stack(out, dim=1)


def compare(model, padded: bool, rows: int = 5, steps: int = 6, seed: int = 0, group: int = 1, **kw) -> float:
    """Max |logit difference| to the HF forward; ``group`` > 1 repeats each prompt that many times."""
    prompts = random_prompts(rows, seed, lo=1 if padded else 9, hi=12 if padded else 9)
    prompts = [p for p in prompts for _ in range(group)]
    rows = len(prompts)
    ids, mask = left_pad(prompts, PAD_TOKEN_ID)
    assert bool(mask.all()) != padded
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens = torch.randint(2, VOCAB, (rows, steps), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        ref = hf_logits(model, ids, mask, positions, tokens)
        got = fast_logits(model, ids, mask, positions, tokens, **kw)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    return float((got - ref).abs().max())


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("name", [*BUILTIN, *CONFIGS])
def test_logits_equal_the_hf_forward(models, name, padded):
    model = models[name]
    assert FastDecoder.unsupported_reason(model, 64) is None
    assert compare(model, padded) < ATOL


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_a_prompt_repeated_in_a_group_is_prefilled_once(models, monkeypatch, padded):
    """The G rows of a group share their prompt: prefill runs it once and every row decodes on its own."""
    model, batches = models["tiny-qwen2"], []
    prefill = FastDecoder._prefill

    def counting(self, input_ids, *args):
        batches.append(len(input_ids))
        return prefill(self, input_ids, *args)

    monkeypatch.setattr(FastDecoder, "_prefill", counting)
    assert compare(model, padded, rows=3, group=4) < ATOL  # 12 rows, 3 prompts; later tokens differ by row
    assert batches == [3]


@pytest.mark.parametrize("layout", ["views", "fused", "dense", "panels"])
def test_each_weight_layout_and_a_single_row(models, layout):
    if layout == "panels" and not cpu_kernels.available():
        pytest.skip(f"the CPU kernel does not run here: {cpu_kernels.unavailable_reason()}")
    model = models["tiny-qwen2"]
    assert compare(model, padded=True, layout=layout) < ATOL
    assert compare(model, padded=False, rows=1, steps=3, layout=layout) < ATOL
    assert compare(model, padded=False, rows=9, steps=3, layout=layout) < ATOL


def test_copies_the_weights_in_the_fastest_layout_that_fits(models, monkeypatch):
    """On CPU the small built-in models get copies of every projection, packed for the CPU kernel where it
    runs, else (in, out); past the copy budget, the fused q/k/v and gate/up only, then views of the
    parameters (nothing copied)."""
    import gpufleet.engine.fastdecode as fastdecode

    model = models["tiny-qwen2"]
    down = model.model.layers[0].mlp.down_proj.weight
    if cpu_kernels.available():
        packed = FastDecoder(model).layers[0].down.packed
        assert torch.equal(packed.panels.transpose(1, 2).reshape(-1, down.shape[1])[: down.shape[0]], down)
        monkeypatch.setattr(cpu_kernels, "_loaded", {"reason": "off in this test"})
    decoder = FastDecoder(model)
    assert decoder.layout == "dense"
    weight, _ = decoder.layers[0].down.parts[0]
    assert weight.is_contiguous() and torch.equal(weight, down.t())
    projections = sum(p.numel() * 4 for n, p in model.model.layers.named_parameters() if "proj.weight" in n)
    monkeypatch.setattr(fastdecode, "_COPY_LIMIT_BYTES", projections)  # the head no longer fits
    assert FastDecoder(model).layout == "fused"
    monkeypatch.setattr(fastdecode, "_COPY_LIMIT_BYTES", 1000)
    decoder = FastDecoder(model)
    assert decoder.layout == "views"
    assert (
        decoder.layers[0].down.parts[0][0].data_ptr() == model.model.layers[0].mlp.down_proj.weight.data_ptr()
    )


def test_attention_implementations_sdpa_and_eager_are_supported():
    model = from_config(CONFIGS["mistral"]())
    model.set_attn_implementation("eager")
    assert FastDecoder.unsupported_reason(model, 64) is None
    assert compare(model, padded=True) < ATOL


class Wrapper(torch.nn.Module):
    """A DDP-like wrapper: the HF model is ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = getattr(module, "config", None)

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_falls_back_when_not_sure_it_is_exact(models):
    model = models["tiny-qwen2"]
    assert FastDecoder.unsupported_reason(model, 64) is None
    assert "wrapped" in FastDecoder.unsupported_reason(Wrapper(model), 64)

    model.train()
    assert "training" in FastDecoder.unsupported_reason(model, 64)
    model.eval()

    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "hooks" in FastDecoder.unsupported_reason(model, 64)
    handle.remove()
    handle = model.model.embed_tokens.register_forward_hook(lambda *args: None)
    assert "hooks" in FastDecoder.unsupported_reason(model, 64)
    handle.remove()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in FastDecoder.unsupported_reason(model, 64)

    with pytest.raises(ValueError, match="does not support"):
        FastDecoder(Wrapper(model))
    assert FastDecoder.unsupported_reason(model, 64) is None

    fsdp_like = from_config(CONFIGS["qwen3"]())  # fully_shard swaps the class for a subclass
    fsdp_like.__class__ = type("FSDPQwen3ForCausalLM", (type(fsdp_like),), {})
    assert "wrapped" in FastDecoder.unsupported_reason(fsdp_like, 64)

    lora_like = from_config(CONFIGS["qwen3"]())
    lora_like.model.layers[0].self_attn.q_proj = Wrapper(lora_like.model.layers[0].self_attn.q_proj)
    assert "expected" in FastDecoder.unsupported_reason(lora_like, 64)

    assert FastDecoder.unsupported_reason(from_config(CONFIGS["mistral"]()).bfloat16(), 64) is None
    assert "float64" in FastDecoder.unsupported_reason(from_config(CONFIGS["mistral"]()).double(), 64)
    mixed = from_config(CONFIGS["mistral"]())
    mixed.lm_head.bfloat16()
    assert "several dtypes" in FastDecoder.unsupported_reason(mixed, 64)
    gpt2 = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
    assert "not Llama" in FastDecoder.unsupported_reason(AutoModelForCausalLM.from_config(gpt2), 64)
    dynamic = LlamaConfig(**_COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in FastDecoder.unsupported_reason(from_config(dynamic), 64)


def test_gradient_checkpointing_keeps_the_fast_path():
    """Gradient checkpointing (on by default for big models) puts transformers' hook on the input
    embedding that marks its output as requiring grad: no value changes, so the fast path stays (it
    once fell back to the Hugging Face forward: 5.6 s vs ~1.2 s a rollout of 16 x 256 on an H200)."""
    model = from_config(CONFIGS["qwen3"]())
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.eval()
    assert model.model.embed_tokens._forward_hooks  # the hook is there
    assert FastDecoder.unsupported_reason(model, 64) is None
    assert compare(model, padded=True) < ATOL


@pytest.mark.parametrize(
    "config",
    [
        lambda: MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=16),
        lambda: Qwen2Config(
            **_COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1
        ),
    ],
    ids=["mistral", "qwen2"],
)
def test_sliding_window_only_when_the_sequence_fits_in_it(config):
    model = from_config(config())
    assert "sliding window" in FastDecoder.unsupported_reason(model, 17)
    assert "sliding window" in FastDecoder.unsupported_reason(model)  # length unknown
    assert FastDecoder.unsupported_reason(model, 16) is None
    assert compare(model, padded=True, rows=3, steps=4) < ATOL  # 12 + 4 tokens: the window is inactive
    with pytest.raises(ValueError, match="sliding window"):
        FastDecoder(model).prefill(*left_pad([[5] * 12], PAD_TOKEN_ID), torch.arange(12)[None], 5)


def test_prefill_wants_left_padding_and_step_a_free_slot(models):
    decoder = FastDecoder(models["tiny-llama"])
    ids = torch.tensor([[5, 6, 0]])
    with torch.inference_mode():
        with pytest.raises(ValueError, match="left-padded"):
            decoder.prefill(ids, torch.tensor([[1, 1, 0]]), torch.tensor([[0, 1, 1]]), 2)
        decoder.prefill(ids, torch.ones_like(ids), torch.arange(3)[None], 1)
        decoder.step(torch.tensor([7]), torch.tensor([[3]]))
        with pytest.raises(RuntimeError, match="full"):
            decoder.step(torch.tensor([7]), torch.tensor([[4]]))


# --- generate: the fast path samples what the HF path samples ------------------------------------


_FAST_DECODER = rollout._fast_decoder


def sample(model, prompts, monkeypatch, fast: bool, **kw):
    """generate() through one path, checking which path ran."""
    monkeypatch.setenv(rollout.FAST_DECODE_ENV, "1" if fast else "0")
    used = []
    monkeypatch.setattr(rollout, "_fast_decoder", lambda *a: used.append(_FAST_DECODER(*a)) or used[-1])
    kw = {"max_new_tokens": 12, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID} | kw
    out = generate(model, prompts, seeds=[100 + i for i in range(len(prompts))], **kw)
    assert (used[0] is not None) == fast
    return out


def assert_same_rollout(a, b):
    for field in a.__dataclass_fields__:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or torch.equal(x, y), field


SAMPLING = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 1.0},
    "filtered": {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    "suppressed": {"temperature": 1.0, "suppress_tokens": (PAD_TOKEN_ID,)},  # pad is never sampled
}


@pytest.mark.parametrize("mode", SAMPLING)
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama", "qwen3", "mistral"])
def test_generate_fast_path_gives_the_hf_path_tokens(models, monkeypatch, name, mode):
    model = models[name]
    groups = [p for p in random_prompts(3, seed=4, lo=2, hi=9) for _ in range(3)]  # prefilled once each
    for prompts in (random_prompts(6, seed=1, lo=1, hi=12), random_prompts(4, seed=2, lo=7, hi=7), groups):
        hf = sample(model, prompts, monkeypatch, fast=False, **SAMPLING[mode])
        fast = sample(model, prompts, monkeypatch, fast=True, **SAMPLING[mode])
        assert_same_rollout(fast, hf)


def rows_finishing_early(model, monkeypatch) -> tuple[list[list[int]], dict]:
    """12 prompts and generate() settings whose EOS is the token ``model`` picks most often."""
    prompts = random_prompts(12, seed=3, lo=1, hi=10)
    probe = sample(model, prompts, monkeypatch, fast=False, temperature=1.0, max_new_tokens=16)
    eos = int(torch.mode(probe.completion_ids.flatten()).values)
    return prompts, dict(temperature=1.0, max_new_tokens=16, eos_token_id=eos)


def test_generate_rows_finishing_at_different_steps(models, monkeypatch):
    """EOS is a token the model often picks, so rows stop at different steps (the rest keep going); the
    fast decoder drops finished rows as it goes, and gives the same rollout as when it keeps them all."""
    model = models["tiny-qwen2"]
    prompts, kw = rows_finishing_early(model, monkeypatch)
    hf = sample(model, prompts, monkeypatch, fast=False, **kw)
    kept: list[int] = []
    keep = FastDecoder.keep
    monkeypatch.setattr(FastDecoder, "keep", lambda self, rows: kept.append(len(rows)) or keep(self, rows))
    assert 0 < int(hf.is_truncated.sum()) < 12 and len(set(hf.completion_lengths.tolist())) > 2
    for fraction in (0.25, 0.05):  # the default; drop at (nearly) every finished row
        monkeypatch.setattr(rollout, "_DROP_FRACTION", fraction)
        assert_same_rollout(sample(model, prompts, monkeypatch, fast=True, **kw), hf)
    assert len(kept) > 1 and kept[-1] < 12
    monkeypatch.setattr(rollout, "_DROP_FRACTION", 2.0)  # never drop a row
    dropped = len(kept)
    assert_same_rollout(sample(model, prompts, monkeypatch, fast=True, **kw), hf)
    assert len(kept) == dropped


def test_generate_reads_the_weights_at_each_call(monkeypatch):
    model = from_config(CONFIGS["qwen3"]())
    prompts = random_prompts(4, seed=6, lo=2, hi=8)
    before = sample(model, prompts, monkeypatch, fast=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # what an optimizer step does (in place) between two rollouts
    after = sample(model, prompts, monkeypatch, fast=True)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert_same_rollout(after, sample(model, prompts, monkeypatch, fast=False))


def test_generate_falls_back_for_a_wrapped_model(models, monkeypatch):
    model = models["tiny-qwen2"]
    prompts = random_prompts(3, seed=4, lo=2, hi=6)
    wrapped = sample(Wrapper(model), prompts, monkeypatch, fast=False)  # asserts the HF path ran
    monkeypatch.setenv(rollout.FAST_DECODE_ENV, "1")
    assert rollout._fast_decoder(Wrapper(model), 20) is None
    assert_same_rollout(wrapped, sample(model, prompts, monkeypatch, fast=True))


def test_hf_path_without_mask_for_unpadded_prompts_equals_hf_generate(models, monkeypatch):
    model = models["tiny-llama"]
    prompts = random_prompts(5, seed=5, lo=6, hi=6)
    ours = sample(model, prompts, monkeypatch, fast=False, temperature=0.0, max_new_tokens=10)
    ids, mask = left_pad(prompts, PAD_TOKEN_ID)
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )[:, ids.shape[1] :]
    assert torch.equal(ours.completion_ids, ref[:, : ours.completion_ids.shape[1]])


@pytest.mark.parametrize("name", ["llama-bias-llama3-rope", "qwen3", "mistral"])
def test_bfloat16_weights_give_the_hf_forwards_logits(name):
    """bfloat16 (and float16) models take the fast path: its norms in float32 cast back before the weight,
    RoPE's tables in the model's dtype, as the HF modules do; on the CPU the same logits as the HF
    forward in bfloat16, prefill and decode steps (its own error against float32 is ~1e-2: bfloat16's)."""
    model = from_config(CONFIGS[name]()).bfloat16()
    prompts = random_prompts(5, seed=0, lo=1, hi=12)
    ids, mask = left_pad(prompts, PAD_TOKEN_ID, "cpu")
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens = torch.randint(2, VOCAB, (5, 6), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = hf_logits(model, ids, mask, positions, tokens)
        decoder = FastDecoder(model)
        got = [decoder.prefill(ids, mask, positions, 6)]
        got += [decoder.step(tokens[:, t], mask.sum(dim=1) + t) for t in range(6)]
    assert decoder.k_cache[0].dtype == torch.bfloat16
    assert float((torch.stack(got, dim=1) - ref).abs().max()) < 1e-6


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_a_float32_model_decodes_in_bfloat16_copies_as_the_cast_model(name):
    """``decode_dtype`` (a GPU job's bf16 precision over float32 weights): the decoder's copies in bfloat16
    give the logits and rollouts of the model cast to bfloat16, and the model keeps its float32 weights."""
    model = from_config(CONFIGS[name]())
    cast = from_config(CONFIGS[name]()).bfloat16()
    cast.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq  # .bfloat16() rounds RoPE's too
    prompts = random_prompts(5, seed=0, lo=1, hi=12)
    ids, mask = left_pad(prompts, PAD_TOKEN_ID, "cpu")
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens = torch.randint(2, VOCAB, (5, 6), generator=torch.Generator().manual_seed(5))

    def logits(decoder: FastDecoder) -> torch.Tensor:
        with torch.inference_mode():
            out = [decoder.prefill(ids, mask, positions, 6)]
            out += [decoder.step(tokens[:, t], mask.sum(dim=1) + t) for t in range(6)]
        return torch.stack(out, dim=1)

    copies = FastDecoder(model, dtype=torch.bfloat16)
    assert copies.k_cache == [] and copies.embed.dtype == torch.bfloat16
    assert torch.equal(logits(copies), logits(FastDecoder(cast)))
    assert next(model.parameters()).dtype == torch.float32
    kw = {
        "seeds": [1, 2, 3, 4, 5],
        "max_new_tokens": 8,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    assert torch.equal(
        generate(model, prompts, decode_dtype="bfloat16", **kw).completion_ids,
        generate(cast, prompts, **kw).completion_ids,
    )
