"""The fast decoder's CUDA-graph step (engine/graphdecode.py): its static-shape step gives the eager step's
logits and the same rollouts (on the CPU, run eagerly), and on a GPU the captured graph replays the bits
of that step (those tests run where CUDA is)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from gpufleet.engine import graphdecode, rollout
from gpufleet.engine.fastdecode import FastDecoder
from gpufleet.engine.graphdecode import GRAPHS_ENV, GraphStep
from gpufleet.engine.rollout import left_pad
from gpufleet.engine.sampling import cumulative
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import materialize
from test_fastdecode import (
    _FAST_DECODER,
    CONFIGS,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    assert_same_rollout,
    from_config,
    hf_logits,
    perturb,
    random_prompts,
    rows_finishing_early,
    sample,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphdecode")
    out = {"tiny-qwen2": perturb(load_causal_lm(str(materialize("tiny-qwen2", root=root))))}
    out |= {name: from_config(CONFIGS[name]()) for name in ("qwen3", "mistral")}
    return out


def prompts_of(kind: str) -> list[list[int]]:
    if kind == "padded":
        return random_prompts(5, seed=0, lo=1, hi=12)
    if kind == "unpadded":
        return random_prompts(4, seed=1, lo=9, hi=9)
    return [p for p in random_prompts(3, seed=2, lo=2, hi=9) for _ in range(3)]  # groups: prefilled once


def step_tokens(rows: int, steps: int, device) -> torch.Tensor:
    return torch.randint(2, 80, (rows, steps), generator=torch.Generator().manual_seed(5)).to(device)


def step_logits(model, prompts, steps: int, graph: str) -> torch.Tensor:
    """(B, 1 + steps, V) logits of a prefill and ``steps`` decode steps on random tokens; ``graph``:
    ``"eager"`` (the decoder's usual step), ``"static"`` (GraphStep run eagerly) or ``"captured"``."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, PAD_TOKEN_ID, device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens = step_tokens(len(prompts), steps, device)
    decoder = FastDecoder(model)
    saved = os.environ.get(GRAPHS_ENV)
    os.environ[GRAPHS_ENV] = "0" if graph == "eager" else "1"
    try:
        with torch.inference_mode():
            out = [decoder.prefill(ids, mask, positions, steps)]
    finally:
        os.environ.pop(GRAPHS_ENV) if saved is None else os.environ.update({GRAPHS_ENV: saved})
    with torch.inference_mode():
        if graph != "eager" and (graph == "static" or decoder.graph is None):
            decoder.graph = GraphStep(decoder, capture=graph == "captured")
        next_pos = mask.sum(dim=1)
        for t in range(steps):
            out.append(decoder.step(tokens[:, t], next_pos + t).clone())
        if graph == "captured":
            assert decoder.graph.graph is not None, "the step was not captured"
    return torch.stack(out, dim=1).cpu()


@pytest.mark.parametrize("kind", ["padded", "unpadded", "groups"])
@pytest.mark.parametrize("name", ["tiny-qwen2", "qwen3", "mistral"])
def test_the_static_step_gives_the_eager_steps_logits(models, name, kind):
    """Attention over the whole cache with the unwritten slots masked = attention over the written ones."""
    eager = step_logits(models[name], prompts_of(kind), 7, "eager")
    static = step_logits(models[name], prompts_of(kind), 7, "static")
    assert float((static - eager).abs().max()) < 1e-5


def static_everywhere(monkeypatch) -> list[GraphStep]:
    """Every FastDecoder gets a GraphStep, run eagerly (on the CPU), as on a GPU; returns them."""
    made: list[GraphStep] = []
    monkeypatch.setattr(GraphStep, "wanted", staticmethod(lambda decoder: True))
    init = GraphStep.__init__
    monkeypatch.setattr(
        GraphStep, "__init__", lambda self, d, capture=None: made.append(self) or init(self, d, capture)
    )
    return made


@pytest.mark.parametrize(
    "mode", [{"temperature": 0.0}, {"temperature": 1.0, "suppress_tokens": (PAD_TOKEN_ID,)}]
)
@pytest.mark.parametrize("name", ["tiny-qwen2", "qwen3"])
def test_generate_through_the_static_step_gives_the_same_rollout(models, monkeypatch, name, mode):
    model = models[name]
    for kind in ("padded", "groups"):
        usual = sample(model, prompts_of(kind), monkeypatch, fast=True, **mode)
        made = static_everywhere(monkeypatch)
        assert_same_rollout(sample(model, prompts_of(kind), monkeypatch, fast=True, **mode), usual)
        assert len(made) == 1 and not made[0].capture
        monkeypatch.undo()


def test_rows_finishing_early_run_on_and_keep_is_refused(models, monkeypatch):
    """With a graph every row runs to the end (keep() would change its shapes): the same rollout."""
    model = models["tiny-qwen2"]
    prompts, kw = rows_finishing_early(model, monkeypatch)
    usual = sample(model, prompts, monkeypatch, fast=True, **kw)
    assert 0 < int(usual.is_truncated.sum()) < 12
    made = static_everywhere(monkeypatch)
    monkeypatch.setattr(rollout, "_DROP_FRACTION", 0.05)  # would drop nearly every finished row
    assert_same_rollout(sample(model, prompts, monkeypatch, fast=True, **kw), usual)
    decoder = FastDecoder(model)
    ids, mask = left_pad(prompts[:2], PAD_TOKEN_ID)
    with torch.inference_mode():
        decoder.prefill(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), 4)
    assert decoder.graph is not None and made
    with pytest.raises(RuntimeError, match="CUDA-graphed"):
        decoder.keep(torch.tensor([0]))


def test_graphs_only_on_a_gpu_and_off_by_environment(models, monkeypatch):
    assert not GraphStep.wanted(FastDecoder(models["tiny-qwen2"]))  # a CPU model
    on_gpu = SimpleNamespace(embed=SimpleNamespace(device=torch.device("cuda", 0)))
    assert GraphStep.wanted(on_gpu)
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert not GraphStep.wanted(on_gpu)
    monkeypatch.delenv(GRAPHS_ENV)
    monkeypatch.setattr(graphdecode, "_failed", ["capture failed"])  # a failed capture: no more tries
    assert not GraphStep.wanted(on_gpu)


# --- on a GPU ----------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kind", ["padded", "unpadded", "groups"])
@pytest.mark.parametrize("name", ["tiny-qwen2", "qwen3", "mistral"])
def test_cuda_graphed_logits_equal_the_hf_forward(models, name, kind):
    """The GPU's own forms (fused RMSNorm, transposed few-row matmuls, masked attention over the whole
    cache) against the HF forward on the same GPU."""
    model = models[name].to("cuda")
    try:
        prompts = prompts_of(kind)
        ids, mask = left_pad(prompts, PAD_TOKEN_ID, "cuda")
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        with torch.inference_mode():
            ref = hf_logits(model, ids, mask, positions, step_tokens(len(prompts), 7, "cuda")).cpu()
        got = step_logits(model, prompts, 7, "captured")
    finally:
        models[name].to("cpu")
    assert float((got - ref).abs().max()) < 1e-5


@needs_cuda
def test_cuda_the_chunked_scan_picks_the_tokens_of_the_plain_scan():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn((16, 151_936), generator=gen) * 3, dim=-1).cuda()
    plain, chunked = cumulative(probs, chunked=False), cumulative(probs)
    assert chunked.shape[1] > plain.shape[1]  # the chunked form ran
    assert torch.allclose(chunked[:, : plain.shape[1]], plain, rtol=0, atol=1e-13)
    u = torch.rand((16, 4096), generator=gen, dtype=torch.float64).cuda()
    picks = [torch.searchsorted(c, u * c[:, -1:], right=True).clamp_(max=151_935) for c in (plain, chunked)]
    assert torch.equal(*picks)


@needs_cuda
@pytest.mark.parametrize("kind", ["padded", "unpadded", "groups"])
@pytest.mark.parametrize("name", ["tiny-qwen2", "qwen3"])
def test_cuda_the_replayed_graph_gives_the_bits_of_the_static_step(models, name, kind):
    model = models[name].to("cuda")
    try:
        captured = step_logits(model, prompts_of(kind), 9, "captured")
        static = step_logits(model, prompts_of(kind), 9, "static")
        eager = step_logits(model, prompts_of(kind), 9, "eager")
    finally:
        models[name].to("cpu")
    assert torch.equal(captured, static)
    assert float((captured - eager).abs().max()) < 1e-5


def sample_keeping_the_decoder(model, prompts, monkeypatch, **kw):
    used: list[FastDecoder | None] = []
    monkeypatch.setattr(rollout, "_fast_decoder", lambda *a: used.append(_FAST_DECODER(*a)) or used[-1])
    kw = {"max_new_tokens": 24, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID} | kw
    out = rollout.generate(model, prompts, seeds=[100 + i for i in range(len(prompts))], **kw)
    assert used[0] is not None
    return out, used[0]


@needs_cuda
@pytest.mark.parametrize(
    "mode", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}]
)
def test_cuda_generate_with_graphs_gives_the_rollout_without(models, monkeypatch, mode):
    model = models["tiny-qwen2"].to("cuda")
    try:
        for kind in ("padded", "groups"):
            monkeypatch.setenv(GRAPHS_ENV, "0")
            eager, decoder = sample_keeping_the_decoder(model, prompts_of(kind), monkeypatch, **mode)
            assert decoder.graph is None
            monkeypatch.delenv(GRAPHS_ENV)
            graphed, decoder = sample_keeping_the_decoder(model, prompts_of(kind), monkeypatch, **mode)
            assert decoder.graph is not None and decoder.graph.graph is not None, "no graph was captured"
            assert_same_rollout(graphed.to("cpu"), eager.to("cpu"))
    finally:
        models["tiny-qwen2"].to("cpu")


@needs_cuda
def test_cuda_rollouts_leave_no_memory_behind(models):
    """Each rollout captures a graph into the pool of the one before: memory stays where it was."""
    model = models["tiny-qwen2"].to("cuda")
    try:
        prompts = prompts_of("groups")
        kw = dict(
            seeds=list(range(len(prompts))), max_new_tokens=16, eos_token_id=1, pad_token_id=PAD_TOKEN_ID
        )
        rollout.generate(model, prompts, **kw)
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        for _ in range(5):
            rollout.generate(model, prompts, **kw)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= allocated
        assert torch.cuda.memory_reserved() <= reserved, (reserved, torch.cuda.memory_reserved())
    finally:
        models["tiny-qwen2"].to("cpu")


@needs_cuda
def test_cuda_a_second_capture_retires_the_first_graph_which_goes_on_eagerly(models):
    """Two rollouts at once: the second capture reuses the first graph's memory, so the first decoder
    stops replaying it and runs its steps eagerly, with the same bits."""
    model = models["tiny-qwen2"].to("cuda")
    try:
        decoders = [FastDecoder(model) for _ in range(3)]
        batches = [
            left_pad(prompts_of(kind), PAD_TOKEN_ID, "cuda") for kind in ("padded", "groups", "padded")
        ]
        logits: list[list[torch.Tensor]] = [[], [], []]
        tokens = torch.full((9,), 7, device="cuda")

        def step(i: int, t: int) -> None:
            ids, mask = batches[i]
            logits[i].append(decoders[i].step(tokens[: len(ids)], mask.sum(dim=1) + t).clone())

        with torch.inference_mode():
            for decoder, (ids, mask) in zip(decoders, batches, strict=True):
                decoder.prefill(ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0), 6)
            for t in range(4):  # decoder 2 alone: captured at its first step, replayed after
                step(2, t)
            step(0, 0), step(0, 1)  # decoder 0 captured (decoder 2 retired, done anyway), replayed
            step(1, 0)  # decoder 1 captured: decoder 0 retired
            assert decoders[0].graph.graph is None and decoders[1].graph.graph is not None
            step(0, 2), step(0, 3), step(1, 1)
        for a, b in zip(logits[0], logits[2], strict=True):
            assert torch.equal(a, b)
    finally:
        models["tiny-qwen2"].to("cpu")
