"""engine/loghead.py: log-probs from the hidden states with the head applied chunk by chunk equal the
full-logits path (GPUFLEET_FUSED_LOGPROBS=0) in values and gradients, for tied and untied heads, Gemma2's
soft-capping, LoRA (peft, head included) and under DDP and FSDP2; the head never sees more than a chunk of
positions, and the model is left as it was (same head module, same config)."""

from __future__ import annotations

import pytest
import torch

from gpufleet.engine import loghead
from gpufleet.engine.loghead import causal_lm
from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.models import load_causal_lm


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=90,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,  # small: the capping changes every logit
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config)


def lora_qwen2():
    from gpufleet.config.schema import ModelSection
    from gpufleet.models.lora import apply

    section = ModelSection(
        use_peft=True, lora_target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0
    )
    model = apply(load_causal_lm("builtin:tiny-qwen2"), section)
    with torch.no_grad():  # non-zero adapters, so their gradients and outputs are not trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return model


def perturbed(path: str):
    model = load_causal_lm(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


MODELS = {
    "qwen2-tied": lambda: perturbed("builtin:tiny-qwen2"),
    "llama-untied": lambda: perturbed("builtin:tiny-llama"),
    "gemma2-softcap": gemma2,
    "qwen2-lora": lora_qwen2,
}


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 80, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0  # left padding
    ids[1, 9:] = 0  # padding after EOS: a suppressed target
    return ids, mask


def run(model, fused: bool, monkeypatch, chunk=None):
    monkeypatch.setenv("GPUFLEET_FUSED_LOGPROBS", "1" if fused else "0")
    model.zero_grad(set_to_none=True)
    ids, mask = batch()
    kw = dict(temperature=0.7, suppress_tokens=(0,), min_new_tokens=2, eos_token_id=1, chunk=chunk)
    logp, entropy = sequence_logprobs(model, ids, mask, 5, **kw)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def assert_same(a, b):
    assert a[0].shape == b[0].shape == (3, 7)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)
    assert a[2].keys() == b[2].keys() and a[2]
    for name in a[2]:
        scale = max(1.0, b[2][name].abs().max().item())
        torch.testing.assert_close(a[2][name], b[2][name], rtol=0, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("chunk", [None, 2])
def test_fused_equals_full_logits(name, chunk, monkeypatch):
    model = MODELS[name]().train()
    assert causal_lm(model) is not None
    head, config = causal_lm(model).lm_head, causal_lm(model).config.to_dict()
    seen: list[int] = []
    hook = head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    linear = torch.nn.functional.linear  # a plain head's weight is applied by loghead._SummedHead

    def counted(x, weight, *rest):
        if type(head) is torch.nn.Linear and weight is head.weight:
            seen.append(x.shape[1])
        return linear(x, weight, *rest)

    monkeypatch.setattr(loghead.F, "linear", counted)
    fused = run(model, True, monkeypatch, chunk)
    hook.remove()
    monkeypatch.setattr(loghead.F, "linear", linear)
    # the head saw chunks of positions only (forward, then each chunk again in backward)
    assert seen and max(seen) <= (chunk or 7) and sum(seen) == 2 * 7
    assert causal_lm(model).lm_head is head and causal_lm(model).config.to_dict() == config
    assert_same(fused, run(model, False, monkeypatch, chunk))


def test_no_grad_and_unsupported_class(monkeypatch):
    model = MODELS["qwen2-tied"]()
    with torch.no_grad():
        fused = sequence_logprobs(model, *batch(), 5, suppress_tokens=(0,))
    monkeypatch.setenv("GPUFLEET_FUSED_LOGPROBS", "0")
    with torch.no_grad():
        full = sequence_logprobs(model, *batch(), 5, suppress_tokens=(0,))
    torch.testing.assert_close(fused, full, rtol=0, atol=1e-6)

    class MyLM(type(model)):  # a subclass may change its forward: not fused
        pass

    assert causal_lm(MyLM(model.config)) is None


@pytest.mark.parametrize("fused", [True, False])
def test_without_entropy_the_same_logprobs(fused, monkeypatch):
    """``entropy=False`` (the no-grad old / reference passes, TRL's compute_entropy=False): no entropy is
    computed (no softmax over the vocabulary), and the log-probs are the same bits."""
    monkeypatch.setenv("GPUFLEET_FUSED_LOGPROBS", "1" if fused else "0")
    model = MODELS["llama-untied"]()
    kw = dict(temperature=0.7, suppress_tokens=(0,), min_new_tokens=2, eos_token_id=1, chunk=3)
    softmaxes = []
    real = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: softmaxes.append(1) or real(*a, **k))
    with torch.no_grad():
        logp, entropy = sequence_logprobs(model, *batch(), 5, **kw)
        assert len(softmaxes) == 3 and entropy.shape == (3, 7)  # one per chunk of 3 of the 7 positions
        softmaxes.clear()
        alone, none = sequence_logprobs(model, *batch(), 5, entropy=False, **kw)
    assert none is None and not softmaxes
    assert torch.equal(alone, logp)


def _wrapped_worker(rank: int, port: int, out: str, wrapper: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = perturbed("builtin:tiny-qwen2").train()
    if wrapper == "ddp":
        model = DistributedDataParallel(model)
        assert causal_lm(model) is model.module
    else:  # as parallel._shard: every decoder layer, then the root (embeddings, norm, head)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert causal_lm(model) is model
    ids, mask = batch()
    logp, _ = sequence_logprobs(model, ids[rank : rank + 2], mask[rank : rank + 2], 5)
    logp.sum().backward()
    inner = model.module if wrapper == "ddp" else model
    grads = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in inner.named_parameters()
    }
    if rank == 0:
        torch.save(grads, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("wrapper", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_wrapped_gradient_is_the_mean_of_the_ranks(wrapper, tmp_path):
    import torch.multiprocessing as mp

    from gpufleet.launch.torchrun import free_port

    out = tmp_path / "grads.pt"
    mp.spawn(_wrapped_worker, args=(free_port(), str(out), wrapper), nprocs=2)
    ddp = torch.load(out)
    model = perturbed("builtin:tiny-qwen2").train()
    ids, mask = batch()
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(2):
        model.zero_grad()
        logp, _ = sequence_logprobs(model, ids[rank : rank + 2], mask[rank : rank + 2], 5)
        logp.sum().backward()
        for n, p in model.named_parameters():
            total[n] += p.grad / 2
    for n in total:
        torch.testing.assert_close(ddp[n], total[n], rtol=0, atol=1e-6, msg=n)
