"""The CPU decode matmul (engine/cpu_kernels.c): torch.mm's values, bits independent of rows and threads, built
once into the cache, and torch.mm in the fast decoder wherever it cannot be built."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from gpufleet.engine import cpu_kernels
from gpufleet.engine.fastdecode import FastDecoder
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import materialize

BUILDS_HERE = (
    platform.machine() == "x86_64"
    and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    and shutil.which("cc") is not None
)
needs_kernel = pytest.mark.skipif(not BUILDS_HERE, reason="needs x86-64 with AVX2 and a C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """cpu_kernels as in a new process, building into an empty cache."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    return tmp_path


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 64])
@pytest.mark.parametrize(("inner", "out"), [(3, 1), (64, 16), (100, 17), (256, 200)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_equals_torch_mm(rows, inner, out, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + inner + out)
    weight = torch.randn(out, inner, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(rows, inner + 5, generator=gen)[:, 2 : inner + 2]  # rows with a stride: no copy needed
    got = cpu_kernels.matmul(x, cpu_kernels.pack([weight], b))
    want = torch.nn.functional.linear(x, weight, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * inner**0.5)


@needs_kernel
@pytest.mark.parametrize("rows", [[16], [7, 20, 3], [1], [32, 32, 5]])
def test_pack_puts_stacked_weights_in_panels_of_16_zero_past_the_end(rows):
    gen = torch.Generator().manual_seed(len(rows))
    weights = [torch.randn(n, 37, generator=gen) for n in rows]
    packed = cpu_kernels.pack([*weights[:-1], weights[-1].t().contiguous().t()], None)  # any strides
    stacked = torch.cat(weights)
    width = cpu_kernels.padded(stacked.shape[0])
    full = torch.cat([stacked, torch.zeros(width - stacked.shape[0], 37)])
    assert torch.equal(packed.panels, full.view(width // 16, 16, 37).transpose(1, 2))
    assert packed.out_features == sum(rows) and packed.bias is None


@needs_kernel
def test_a_row_has_the_same_bits_with_any_rows_and_threads():
    gen = torch.Generator().manual_seed(0)
    packed = cpu_kernels.pack([torch.randn(100, 256, generator=gen)], torch.randn(100, generator=gen))
    x = torch.randn(16, 256, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu_kernels.matmul(x[i : i + 1], packed) for i in range(16)])
        torch.set_num_threads(2)
        together = cpu_kernels.matmul(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@needs_kernel
def test_built_once_into_the_cache(fresh):
    assert cpu_kernels.available() and cpu_kernels.unavailable_reason() is None
    (built,) = (fresh / "cache" / "kernels").glob("cpu_kernels-*.so")
    stamp = built.stat().st_mtime_ns
    cpu_kernels._loaded.clear()
    assert cpu_kernels.available() and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no partial file left


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_causal_lm(str(materialize("tiny-qwen2", root=tmp_path_factory.mktemp("m")))).eval()


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        pytest.param({"GPUFLEET_CPU_KERNELS": "0"}, "GPUFLEET_CPU_KERNELS=0", id="turned-off"),
        pytest.param(
            {"CC": "false"}, "could not build cpu_kernels.c", id="compiler-fails", marks=needs_kernel
        ),
    ],
)
def test_the_decoder_uses_torch_mm_where_the_kernel_cannot_run(fresh, monkeypatch, model, env, reason):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "CC" in env:  # the named compiler is the one tried first
        monkeypatch.setattr(
            cpu_kernels.shutil, "which", lambda name: "/bin/false" if name == "false" else None
        )
    assert not cpu_kernels.available() and reason in cpu_kernels.unavailable_reason()
    decoder = FastDecoder(model)
    assert decoder.layout == "dense" and decoder.layers[0].qkv.packed is None
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.pack([torch.ones(2, 4)])


def python_step(decoder: FastDecoder) -> FastDecoder:
    decoder.native = None
    return decoder


@pytest.fixture(scope="module", params=["tiny-qwen2", "head-dim-64", "head-dim-24"])
def step_model(request, model):
    """The decode step's attention blocks by head_dim: 64 (the 64-wide output block), 24 (no block of
    16: one key at a time and the scalar tail), tiny-qwen2's 16."""
    if request.param == "tiny-qwen2":
        return model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    head_dim = int(request.param.rsplit("-", 1)[1])
    config = Qwen2Config(
        vocab_size=model.config.vocab_size,
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_native_decode_step_equals_the_python_step(step_model, threads):
    """On CPU the decode step runs in C by default; its logits equal the Python step's within 1e-6 (the
    HF forward's are checked for every family in test_fastdecode.py), the same bits at 1 and 2 threads,
    and the KV cache it writes is the Python step's."""
    model = step_model
    from gpufleet.engine.rollout import left_pad
    from test_fastdecode import random_prompts

    ids, mask = left_pad(random_prompts(5, 0, lo=1, hi=9), 0)  # left-padded: the key mask is used
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens = torch.randint(2, 40, (5, 6), generator=torch.Generator().manual_seed(1))
    saved = torch.get_num_threads()
    runs = []
    try:
        torch.set_num_threads(threads)
        for make in (FastDecoder, lambda m: python_step(FastDecoder(m)), FastDecoder):
            decoder = make(model)
            with torch.inference_mode():
                out = [decoder.prefill(ids, mask, positions, 6)]
                out += [decoder.step(tokens[:, t], mask.sum(dim=1) + t) for t in range(6)]
            runs.append((decoder.native is not None, torch.stack(out, 1), decoder.k_cache[-1].clone()))
            torch.set_num_threads(1)  # the second native run at one thread
    finally:
        torch.set_num_threads(saved)
    (native, got, cache), (python, want, want_cache), (_, again, _) = runs
    assert native and not python
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=1e-5)
    assert torch.equal(got[:, 1:], again[:, 1:])  # the steps; the prefill runs torch ops in Python


@needs_kernel
def test_a_token_outside_the_vocabulary_or_a_position_outside_the_cache_is_refused(model):
    from gpufleet.engine.rollout import left_pad

    decoder = FastDecoder(model)
    ids, mask = left_pad([[5, 6], [7, 8]], 0)
    with torch.inference_mode():
        decoder.prefill(ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0), 4)
        with pytest.raises(IndexError, match="token 100000 of row 1 is not in the embedding table"):
            decoder.step(torch.tensor([5, 100000]), torch.tensor([2, 2]))
        with pytest.raises(IndexError, match=r"position 6 of row 0 is outside the cache \(6\)"):
            decoder.step(torch.tensor([5, 5]), torch.tensor([6, 2]))
