"""Decode speed against the memory-bandwidth limit (issue 37, item 1), gpufleet's decoder beside HF's.

    python3 bench/gpu_decode.py --device cuda                         # the issue's table (bf16)
    .venv/bin/python bench/gpu_decode.py --device cpu                 # the same table at small shapes

For each model (random weights built from Qwen2.5-0.5B's / 1.5B's config.json shapes, in bf16 on the
GPU), each row count and each variant of the decoder, one ``engine.rollout.generate`` call of
``--prompt`` prompt tokens and ``--new`` new tokens (``min_new_tokens`` = ``--new``: no early EOS;
prompts repeated in groups of 8 as GRPO's completions are) is timed against the same call with one new
token: the difference is the decode steps alone. The limit of a decode step is the bytes it must read
(every weight once, the LM head included, plus every key and value cached so far) over the bandwidth of
a device-to-device copy measured at the start (bytes read + written); the table prints ms per step
against that limit as a fraction, and tokens/s. Variants (environment switches of ``engine/``):

* ``graph``: the decoder as it was (CUDA graph, SDPA over the whole cache and its mask, no fusion);
* ``+attention``: ``gpuattention``'s Triton kernels (the keys each row holds, once per GQA group);
* ``+compile``: that and ``decodecompile`` (each layer's elementwise work fused by ``torch.compile``).

``--hf-rows``: the same timing of ``model.generate`` (Hugging Face, what TRL's generation calls) at
that many rows, the side-by-side. Results also go to ``--out`` as JSON. Tests never assert on times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from measure import BENCH_MODELS

from gpufleet.engine.decodecompile import COMPILE_ENV
from gpufleet.engine.gpuattention import ATTENTION_ENV
from gpufleet.engine.rollout import generate
from gpufleet.engine.sampling import cumulative, search_chunks
from gpufleet.models.builtin import builtin_config

VARIANTS = {
    "graph": {ATTENTION_ENV: "0", COMPILE_ENV: "0"},
    "+attention": {ATTENTION_ENV: "1", COMPILE_ENV: "0"},
    "+compile": {ATTENTION_ENV: "1", COMPILE_ENV: "1"},
}


def sync(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth(device: str, size: int) -> float:
    """Bytes per second of a device-to-device copy of ``size`` bytes (read + written), best of 10."""
    a = torch.empty(size, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(10):
        start = sync(device)
        b.copy_(a)
        best = min(best, sync(device) - start)
    return 2 * size / best


def build(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight causal LM with ``name``'s shapes (``BENCH_MODELS`` or a built-in model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = (
        builtin_config("tiny-qwen2") | BENCH_MODELS[name] if name in BENCH_MODELS else builtin_config(name)
    )
    config = AutoConfig.for_model(**config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def step_bytes(model: torch.nn.Module, rows: int, context: int) -> int:
    """Bytes one decode step must read: every weight once (a tied embedding once, as the head) and
    the keys and values of ``context`` tokens of every row."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # the embedding table is gathered, not streamed
        weights -= (
            model.get_input_embeddings().weight.numel() * model.get_input_embeddings().weight.element_size()
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    return weights + rows * context * per_token


def prompts(rows: int, length: int, vocab: int, group: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(rows)
    distinct = [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(-(-rows // group))]
    return [p for p in distinct for _ in range(group)][:rows]


def timed(fn, device: str, repeats: int, warm_up=None) -> tuple[float, object]:
    (warm_up or fn)()  # warm-up (and compilation)
    times, out = [], None
    for _ in range(repeats):
        start = sync(device)
        out = fn()
        times.append(sync(device) - start)
    return statistics.median(times), out


def ours(model, rows: list[list[int]], new: int):
    return generate(
        model, rows, seeds=list(range(len(rows))), max_new_tokens=new, eos_token_id=1, pad_token_id=0,
        min_new_tokens=new,
    ).completion_ids  # fmt: skip


def hf(model, rows: list[list[int]], new: int):
    ids = torch.tensor(rows, device=model.device)
    with torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
            min_new_tokens=new, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip


def decode_seconds(run, model, rows, new, device, repeats) -> tuple[float, object]:
    """Seconds of the ``new`` - 1 decode steps: a call with ``new`` tokens minus one with 1."""
    full, out = timed(lambda: run(model, rows, new), device, repeats, lambda: run(model, rows, 8))
    first, _ = timed(lambda: run(model, rows, 1), device, repeats)
    return full - first, out


def sampler_micro(device: str, rows: int, vocab: int) -> dict:
    """us per pick at ``rows`` x ``vocab``: the full float64 scan (before) vs ``search_chunks``."""
    probs = torch.softmax(torch.randn(rows, vocab, device=device), dim=-1)
    u = torch.rand(rows, dtype=torch.float64, device=device)

    def full():
        cdf = cumulative(probs)
        return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)

    out = {}
    for name, fn in (("full scan", full), ("two-level", lambda: search_chunks(probs, u))):
        out[name] = timed(fn, device, 20)[0] * 1e6
    out["same"] = bool(torch.equal(full().clamp(max=vocab - 1), search_chunks(probs, u)))
    return out


def profile(model, rows: list[list[int]], device: str, top: int = 18) -> None:
    """The GPU time of one short ``generate`` (prefill + 24 decode steps) by kernel, the largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ours(model, rows, 8)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        ours(model, rows, 25)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=150), flush=True)
    # the host-side ops that launched those kernels, by input shape (which tensors the copies and adds touch)
    by_shape = prof.key_averages(group_by_input_shape=True)
    print(by_shape.table(sort_by=key, row_limit=top, max_name_column_width=40, max_shapes_column_width=80))


def check(model, rows: list[list[int]], steps: int = 8) -> str:
    """The decoder's logits (prefill + ``steps`` decode steps on random tokens, as ``generate`` runs them:
    CUDA graph, kernels, compiled pieces) against the HF forward's on the same device and dtype:
    max |diff| and ||diff|| / ||HF||."""
    from gpufleet.engine.fastdecode import FastDecoder
    from gpufleet.engine.rollout import left_pad

    device = model.device
    ids, mask = left_pad(rows, 0, device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens = torch.randint(2, model.config.vocab_size, (len(rows), steps), device=device)
    with torch.inference_mode():
        decoder = FastDecoder(model)
        got = [decoder.prefill(ids, mask, positions, steps)]
        got += [decoder.step(tokens[:, t], mask.sum(dim=1) + t).clone() for t in range(steps)]
        captured = decoder.graph is not None and decoder.graph.graph is not None
        ref = [model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()]
        for t in range(steps):  # the whole sequence again each step: no cache of HF's in the comparison
            seq = torch.cat([ids, tokens[:, : t + 1]], dim=1)
            full = torch.cat([mask, torch.ones_like(tokens[:, : t + 1])], dim=1)
            ref.append(model(input_ids=seq, attention_mask=full).logits[:, -1].float())
    diff = torch.stack(got) - torch.stack(ref)
    relative = float(diff.norm() / torch.stack(ref).norm())
    return f"max |diff| {float(diff.abs().max()):.3g}, relative {relative:.2e}, graph captured {captured}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--models", default=None, help="default: qwen2.5-0.5b,qwen2.5-1.5b (cpu: tiny-qwen2)")
    ap.add_argument("--rows", default=None, help="default 16,64,256 (cpu: 4,8)")
    ap.add_argument("--prompt", type=int, default=None, help="default 256 (cpu: 16)")
    ap.add_argument("--new", type=int, default=None, help="default 512 (cpu: 32)")
    ap.add_argument("--variants", default="graph,+attention,+compile")
    ap.add_argument("--hf-rows", type=int, default=None, help="default 64 (cpu: 8); 0: none")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profile", default="", help="MODEL:ROWS:VARIANT,...: kernel tables of a short generate")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "gpu_decode.json")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    models = (a.models or ("qwen2.5-0.5b,qwen2.5-1.5b" if gpu else "tiny-qwen2")).split(",")
    row_counts = [int(r) for r in (a.rows or ("16,64,256" if gpu else "4,8")).split(",")]
    prompt, new = a.prompt or (256 if gpu else 16), a.new or (512 if gpu else 32)
    hf_rows = (64 if gpu else 8) if a.hf_rows is None else a.hf_rows
    dtype = torch.bfloat16 if gpu else torch.float32
    bandwidth = copy_bandwidth(a.device, (2 << 30) if gpu else (256 << 20))
    card = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"{card}, torch {torch.__version__}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    sampler = sampler_micro(a.device, 256 if gpu else 16, 151936 if gpu else 8192)
    print(f"sampler, {256 if gpu else 16} rows x {151936 if gpu else 8192}: full scan {sampler['full scan']:.0f} us, two-level "
          f"{sampler['two-level']:.0f} us, same tokens {sampler['same']}")  # fmt: skip
    results = {"card": card, "bandwidth": bandwidth, "sampler": sampler, "rows": []}
    print(f"{'model':13s} {'rows':>4s} {'variant':11s} {'ms/step':>8s} {'limit ms':>8s} {'of limit':>8s} "
          f"{'tokens/s':>9s}  same tokens")  # fmt: skip
    for name in models:
        model = build(name, a.device, dtype)
        print(
            f"{name}: decoder vs HF forward, {dtype}: {check(model, prompts(16, 64, model.config.vocab_size))}"
        )
        for n in sorted(set(row_counts + ([hf_rows] if hf_rows else []))):
            rows = prompts(n, prompt, model.config.vocab_size)
            limit = sum(step_bytes(model, n, prompt + s) for s in range(1, new)) / bandwidth / (new - 1)
            runs = [(v, ours, VARIANTS[v]) for v in a.variants.split(",")] if n in row_counts else []
            runs += [("HF generate", hf, {})] if n == hf_rows else []
            first = None
            for variant, run, env in runs:
                os.environ.update(env)
                try:
                    seconds, out = decode_seconds(run, model, rows, new, a.device, a.repeats)
                except Exception as error:  # noqa: BLE001 - a bench row, not the product: say and go on
                    print(f"{name:13s} {n:4d} {variant:11s} failed: {type(error).__name__}: {error}"[:300])
                    continue
                per_step = seconds / (new - 1)
                same = "" if run is hf else str(first is None or torch.equal(first, out))
                first = out if first is None and run is ours else first
                row = dict(model=name, rows=n, variant=variant, ms_per_step=per_step * 1e3,
                           limit_ms=limit * 1e3, fraction=limit / per_step, tokens_per_s=n / per_step)  # fmt: skip
                results["rows"].append(row)
                print(f"{name:13s} {n:4d} {variant:11s} {per_step * 1e3:8.3f} {limit * 1e3:8.3f} "
                      f"{limit / per_step:8.1%} {n / per_step:9.0f}  {same}", flush=True)  # fmt: skip
        for spec in filter(None, a.profile.split(",")):
            target, n, variant = spec.split(":")
            if target == name:
                print(f"--- profile: {name}, {n} rows, {variant}")
                os.environ.update(VARIANTS[variant])
                profile(model, prompts(int(n), prompt, model.config.vocab_size), a.device)
        del model
        if gpu:
            torch.cuda.empty_cache()
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
