"""The update's forward + backward against the bf16 matmul peak (issue 37, item 2).

    python3 bench/gpu_update.py --device cuda                          # 8 x 1,024 tokens, 0.5B and 1.5B shapes
    .venv/bin/python bench/gpu_update.py --device cpu                  # small shapes on the CPU

One training forward + backward of the policy as gpufleet's step runs it (``sequence_logprobs`` with
the chunked log-prob head and the entropy, a loss over the completion's log-probs) on ``--rows`` x
``--tokens`` random tokens (the last ``--completion`` of them the completion), timed between
synchronisations (median of ``--repeats`` after 2 warm-ups), in each mode:

* ``autocast``: fp32 weights, bf16 autocast (``train.precision: bf16``);
* ``fsdp-mp``: FSDP2 over a one-rank group with mixed precision (bf16 parameters gathered, fp32
  reduction: what ``placement.strategy: fsdp`` runs with bf16);
* ``autocast+compile``: ``autocast`` with every decoder layer compiled (``train.torch_compile``:
  ``engine/compiled.compile_layers``; the compilation is in the warm-ups);
* ``autocast+liger``: ``autocast`` after Liger Kernel's Qwen2 patches (its RMSNorm, RoPE and SwiGLU
  kernels; only where ``liger_kernel`` imports), the kernel library TRL's ``use_liger_kernel`` uses.

FLOPs are counted as ``bench/flops.py`` counts them (forward x 3); the peak is a bf16 8192^3 matmul
on random data measured first. Prints each mode's ms, TFLOP/s and fraction of the peak. No assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from pathlib import Path

import torch
from flops import forward_flops
from gpu_decode import build, sync

from gpufleet.engine.compiled import compile_layers
from gpufleet.engine.logprobs import sequence_logprobs


def matmul_peak(device: str, size: int) -> float:
    """FLOP/s of a random bf16 (fp32 on the CPU) ``size``^3 matmul, best of 10 after 3 warm-ups."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        start = sync(device)
        a @ b
        best = min(best, sync(device) - start)
    return 2 * size**3 / best


def fsdp_one_rank(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """``model`` under FSDP2 with bf16 mixed precision on a one-rank process group (gpufleet's _shard)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def liger(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` with Liger Kernel's Qwen2 RMSNorm / RoPE / SwiGLU, or None where it does not import."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    except ImportError:
        return None
    apply_liger_kernel_to_qwen2(
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
        model=model,
    )
    return model


def step_seconds(model, ids, completion: int, autocast: bool, repeats: int) -> float:
    device = ids.device.type
    mask = torch.ones_like(ids)
    start_of_completion = ids.shape[1] - completion

    def once():
        ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            logp, entropy = sequence_logprobs(model, ids, mask, start_of_completion, pack_over=None)
        (-(logp.mean()) + 0.0 * entropy.mean()).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        once()
    times = []
    for _ in range(repeats):
        start = sync(device)
        once()
        times.append(sync(device) - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--models", default=None, help="default qwen2.5-0.5b,qwen2.5-1.5b (cpu: tiny-qwen2)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=None, help="default 1024 (cpu: 128)")
    ap.add_argument("--completion", type=int, default=None, help="default 960 (cpu: 96)")
    ap.add_argument("--modes", default="autocast,autocast+compile,fsdp-mp,autocast+liger")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "gpu_update.json")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    models = (a.models or ("qwen2.5-0.5b,qwen2.5-1.5b" if gpu else "tiny-qwen2")).split(",")
    tokens, completion = a.tokens or (1024 if gpu else 128), a.completion or (960 if gpu else 96)
    peak = matmul_peak(a.device, 8192 if gpu else 1024)
    card = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"{card}: matmul peak {peak / 1e12:.0f} TFLOP/s ({'bf16' if gpu else 'fp32'}, random data)")
    print(f"{'model':13s} {'mode':15s} {'ms':>8s} {'TFLOP/s':>8s} {'of peak':>8s}")
    results = {"card": card, "peak": peak, "rows": []}
    for name in models:
        for mode in a.modes.split(","):
            model = build(name, a.device, torch.float32).train()
            if mode == "fsdp-mp":
                model = fsdp_one_rank(model, a.device)
            if mode.endswith("+compile"):
                compile_layers(model)
            if mode.endswith("+liger") and liger(model) is None:
                print(f"{name:13s} {mode:15s} skipped: liger_kernel does not import")
                continue
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(2, model.config.vocab_size, (a.rows, tokens), generator=g).to(a.device)
            seconds = step_seconds(model, ids, completion, mode != "fsdp-mp", a.repeats)
            flops = 3 * forward_flops(model.config.to_dict(), a.rows, tokens, completion)
            results["rows"].append(
                dict(model=name, mode=mode, ms=seconds * 1e3, flops=flops, fraction=flops / seconds / peak)
            )
            print(f"{name:13s} {mode:15s} {seconds * 1e3:8.1f} {flops / seconds / 1e12:8.1f} "
                  f"{flops / seconds / peak:8.1%}", flush=True)  # fmt: skip
            del model
            if gpu:
                torch.cuda.empty_cache()
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
