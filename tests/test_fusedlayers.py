"""The fused RMSNorm, SwiGLU and attention (RoPE in C, SDPA over the key/value heads) of the CPU training
forward (engine/fusedlayers.py) against the models' own code: values and gradients, thread counts, rows, and
the cases that keep the models' own code."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm, apply_rotary_pos_emb

from gpufleet.engine import cpu_kernels, fusedlayers
from gpufleet.engine.fusedlayers import fused_layers, rms_norm, swiglu
from gpufleet.engine.logprobs import sequence_logprobs
from test_fastdecode import CONFIGS, VOCAB

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))


def _norm(width: int) -> Qwen2RMSNorm:
    norm = Qwen2RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return norm


def _mlp(hidden: int, inter: int) -> Qwen2MLP:
    torch.manual_seed(0)
    return Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu"))


def _grads(fn, module, x):
    """Output, input gradient and parameter gradients of ``fn(module, x)`` under a fixed output gradient."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(module, x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


def _own(module, x):
    return type(module).forward(module, x)


@pytest.mark.parametrize("width", [256, 37, 8])
def test_norm_equals_the_models_norm_forward_and_backward(width):
    norm = _norm(width)
    x = torch.randn(3, 7, width, generator=torch.Generator().manual_seed(0)) * 3
    ours, theirs = _grads(rms_norm, norm, x), _grads(_own, norm, x)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("inter", [96, 45])
def test_swiglu_equals_the_models_mlp_forward_and_backward(inter):
    mlp = _mlp(24, inter)
    x = torch.randn(4, 5, 24, generator=torch.Generator().manual_seed(0)) * 4  # silu's tails included
    ours, theirs = _grads(swiglu, mlp, x), _grads(_own, mlp, x)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_frozen_norm_weight_gets_no_gradient_and_the_input_still_does():
    norm = _norm(16).requires_grad_(False)
    x = torch.randn(5, 16, requires_grad=True)
    rms_norm(norm, x).sum().backward()
    assert norm.weight.grad is None and x.grad is not None


@pytest.mark.parametrize("head_dim", [64, 12])  # 8-float vectors; a scalar tail (half of 12 is 6)
@pytest.mark.parametrize("shared", [True, False], ids=["cos-1xTxD", "cos-BxTxD"])
def test_rope_has_the_bits_of_the_models_rope_forward_and_backward(head_dim, shared):
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(3, 7, 4, head_dim, generator=g, requires_grad=True)  # (B, T, H, D): a projection's view
    angles = torch.randn(1 if shared else 3, 7, head_dim // 2, generator=g) * 3
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos() * 0.9, emb.sin() * 0.9  # attention_scaling != 1
    theirs, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    ours = fusedlayers._Rope.apply(x, cos, sin)
    assert ours.is_contiguous() and torch.equal(ours, theirs)
    gout = torch.randn(theirs.shape, generator=g)
    assert torch.equal(torch.autograd.grad(ours, x, gout)[0], torch.autograd.grad(theirs, x, gout)[0])


def _fused(kind: str):
    """The fused part alone (no matmul around it): x -> its output, under torch's autograd."""
    if kind == "norm":
        norm = _norm(256)
        return lambda x: rms_norm(norm, x)
    return lambda x: fusedlayers._SwiGLU.apply(x[:, :384], x[:, 384:])


@pytest.mark.parametrize("kind,width", [("norm", 256), ("swiglu", 768)])
def test_results_do_not_depend_on_the_thread_count_or_the_other_rows(kind, width):
    fn = _fused(kind)
    x = torch.randn(300, width, generator=torch.Generator().manual_seed(0)) * 3  # enough for threads
    gout = torch.randn(300, 256 if kind == "norm" else 384, generator=torch.Generator().manual_seed(1))

    def run(rows):
        xr = x[rows].clone().requires_grad_(True)
        out = fn(xr)
        out.backward(gout[rows])
        return out.detach(), xr.grad

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(slice(None))
        torch.set_num_threads(2)
        two = run(slice(None))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    alone = run(slice(5, 6))
    assert torch.equal(alone[0], one[0][5:6]) and torch.equal(alone[1], one[1][5:6])


def _model(kind: str, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind]()).to(dtype).train()


def _step(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model.zero_grad(set_to_none=True)
    logp, _ = sequence_logprobs(model, ids, mask, 4)
    (logp * torch.randn(logp.shape, generator=g, dtype=logp.dtype)).sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "llama-bias-llama3-rope"])
def test_training_step_equals_the_models_own_code(kind, monkeypatch):
    model = _model(kind)
    swapped = []
    original = fusedlayers._swaps
    monkeypatch.setattr(fusedlayers, "_swaps", lambda *a: swapped.extend(found := original(*a)) or found)
    logp, grads = _step(model)
    names = {type(m).__name__ for m, _ in swapped}
    assert {"RMSNorm", "MLP", "Attention"} <= {n.removeprefix(kind.split("-")[0].title()) for n in names}, (
        names
    )
    assert all("forward" not in m.__dict__ for m, _ in swapped)  # restored after the block
    monkeypatch.setenv(fusedlayers.ENV, "0")
    swapped.clear()
    own_logp, own_grads = _step(model)
    assert not swapped
    torch.testing.assert_close(logp, own_logp, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, own_grads[name], rtol=1e-4, atol=5e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def _is_swapped(model) -> bool:
    with fused_layers(model):
        return any("forward" in m.__dict__ for m in model.modules())


def test_models_own_code_where_fusing_does_not_apply():
    assert _is_swapped(_model("qwen3"))
    assert not _is_swapped(_model("qwen3", torch.float64))  # not float32
    checkpointed = _model("qwen3")
    checkpointed.gradient_checkpointing_enable()
    assert not _is_swapped(checkpointed)  # recomputed in backward with the modules' own code
    with torch.no_grad():
        assert _is_swapped(checkpointed)  # nothing is recomputed without gradients
    compiled = _model("qwen3")
    compiled.model.layers[0].compile()  # sets the compiled call; nothing compiles before a call
    assert not _is_swapped(compiled)


def test_the_swap_is_undone_when_the_forward_fails():
    model = _model("qwen3")
    with pytest.raises(RuntimeError), fused_layers(model):
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    "kind", ["mistral", "llama-bias-llama3-rope", "qwen2-yarn-rope"]
)  # KV heads 1, 4/4, 2
@pytest.mark.parametrize("padded", [True, False])
def test_attention_has_the_bits_of_the_modules_own_code_forward_and_backward(kind, padded):
    model = _model(kind)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9, model.config.hidden_size, generator=g)
    cos, sin = model.model.rotary_emb(x, torch.arange(9)[None].expand(3, 9))
    mask = None  # SDPA's causal attention, as Hugging Face passes it without padding
    if padded:  # a left-padded row: a boolean mask, pad queries seeing themselves
        mask = torch.ones(3, 1, 9, 9, dtype=torch.bool).tril()
        mask[0, :, :, :3] = False
        mask |= torch.eye(9, dtype=torch.bool)
    gout = torch.randn(3, 9, model.config.hidden_size, generator=g)

    def run(forward):
        xr = x.clone().requires_grad_(True)
        attn.zero_grad(set_to_none=True)
        out = forward(attn, xr, (cos, sin), mask)[0]
        out.backward(gout)
        return [out.detach(), xr.grad, *(p.grad for p in attn.parameters())]

    with fused_layers(model):
        assert "forward" in attn.__dict__
    for ours, theirs in zip(run(fusedlayers.attention), run(type(attn).forward), strict=True):
        assert torch.equal(ours, theirs)


def test_attention_takes_its_own_code_where_fusing_does_not_apply(monkeypatch):
    model = _model("qwen3")
    calls = []
    real = fusedlayers._Rope.apply
    monkeypatch.setattr(fusedlayers._Rope, "apply", lambda *args: calls.append(1) or real(*args))
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    logp, _ = _step(model)
    assert calls  # SDPA, float32, no cache: fused
    calls.clear()
    model.set_attn_implementation("eager")
    eager, _ = _step(model)
    assert not calls
    torch.testing.assert_close(logp, eager, rtol=0, atol=1e-5)
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), fused_layers(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, use_cache=False)
        model(input_ids=ids, use_cache=True)  # a cache (Hugging Face's decoding)
    assert not calls
