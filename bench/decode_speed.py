"""CPU time of ``generate`` with the fast decode path (``FastDecoder``) vs the Hugging Face forward.

    .venv/bin/python bench/decode_speed.py [--models tiny-qwen2,small-qwen2] [--repeats 15] [--threads 1]
    .venv/bin/python bench/decode_speed.py --models small-qwen2 --shapes 16x32 --prompt-tokens 128 --group 8
    .venv/bin/python bench/decode_speed.py --models qwen2-256x4 --shapes 16x64 --prompt-tokens 2 --group 8 --vs torch
    python3 bench/decode_speed.py --device cuda --shapes 16x64 --group 8    # GPU: wall time per call
    python3 bench/decode_speed.py --device cuda --models qwen2.5-0.5b --shapes 16x64 --group 8 --vs graphs

``--vs torch`` compares the fast path with its CPU kernels (``engine/cpu_kernels.c``: the decode step in C)
against the same fast path as torch ops (``GPUFLEET_CPU_KERNELS=0``) instead of against the HF forward;
``--vs graphs`` (GPU) the fast path with its decode step replayed as a CUDA graph against the same path
run eagerly (``GPUFLEET_CUDA_GRAPHS=0``).
``--models`` takes built-in models and ``measure.BENCH_MODELS`` (``qwen2-256x4``: the ``small`` preset's).

For each built-in model and shape (rows x new tokens: 8x32 and 128x10 by default), both paths sample
the same left-padded prompts with the same seeds (temperature 1), alternating run by run so that load
from other processes hits both alike. Prompts are random, 8-24 tokens (``--prompt-tokens``: LO-HI or
N); ``--group G`` repeats each G times, as the G completions of a GRPO group (the fast path runs a
repeated prompt once). Times are process CPU time (``time.process_time``), so the
machine being shared inflates them less than wall time. No assertions; it prints the median and best
per path, their ratio, and whether both paths sampled the same tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import replace

import torch
from measure import BENCH_MODELS, PRESETS, model_folder

from gpufleet.engine import cpu_kernels
from gpufleet.engine.fastdecode import FastDecoder
from gpufleet.engine.graphdecode import GRAPHS_ENV
from gpufleet.engine.rollout import FAST_DECODE_ENV, generate
from gpufleet.models import load_causal_lm
from gpufleet.models.builtin import EOS_TOKEN_ID, PAD_TOKEN_ID, materialize


def prompts(rows: int, lengths: tuple[int, int] = (8, 24), group: int = 1, seed: int = 0) -> list[list[int]]:
    """``rows`` prompts of random tokens, each distinct one repeated ``group`` times in a row."""
    rnd = random.Random(seed)
    distinct = [
        [rnd.randrange(2, 86) for _ in range(rnd.randint(*lengths))] for _ in range(-(-rows // group))
    ]
    return [p for p in distinct for _ in range(group)][:rows]


def clock(device: str) -> float:
    """Process CPU time on the CPU; on a GPU, wall time after the GPU's queue has drained."""
    if device == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def run(model, rows: list[list[int]], new_tokens: int, fast: bool, vs: str = "hf"):
    """One ``generate`` call: the fast path, or the other path (``vs``: the HF forward, the fast path
    as torch ops, the CPU kernels turned off for this call, or the fast path without CUDA graphs)."""
    os.environ[FAST_DECODE_ENV] = "1" if fast or vs in ("torch", "graphs") else "0"
    os.environ[GRAPHS_ENV] = "0" if not fast and vs == "graphs" else "1"
    cpu_kernels.library()  # loaded (or not) once, outside the timing
    saved = dict(cpu_kernels._loaded)
    if not fast and vs == "torch":
        cpu_kernels._loaded.clear()
        cpu_kernels._loaded["reason"] = "turned off by decode_speed.py --vs torch"
    device = model.device.type
    start = clock(device)
    out = generate(
        model,
        rows,
        seeds=list(range(len(rows))),
        max_new_tokens=new_tokens,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        temperature=1.0,
    )
    elapsed = clock(device) - start
    cpu_kernels._loaded.clear()
    cpu_kernels._loaded.update(saved)
    return elapsed, out.completion_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-qwen2,small-qwen2")
    ap.add_argument("--shapes", default="8x32,128x10", help="rows x new tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prompt-tokens", default="8-24", help="prompt length: LO-HI (random) or N")
    ap.add_argument("--group", type=int, default=1, help="rows per distinct prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: GPU wall time per call")
    ap.add_argument(
        "--vs",
        choices=("hf", "torch", "graphs"),
        default="hf",
        help="the other path: the HF forward, torch ops, or no CUDA graphs",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = os.environ.get(FAST_DECODE_ENV)
    lo, _, hi = args.prompt_tokens.partition("-")
    lengths = (int(lo), int(hi or lo))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.device}, "
        f"{'CPU' if args.device == 'cpu' else 'wall'} time per generate call; prompts of "
        f"{args.prompt_tokens} tokens, {args.group} row(s) each"
    )
    other = {"hf": "HF", "torch": "torch", "graphs": "eager"}[args.vs]
    print(
        f"{'model':12s} {'shape':>7s} {other + ' median':>10s} {'fast median':>12s} {other + ' best':>8s} "
        f"{'fast best':>9s} {'speed-up':>8s}  same tokens"
    )
    try:
        with tempfile.TemporaryDirectory() as root:
            for name in args.models.split(","):
                folder = (
                    model_folder(replace(PRESETS["small"], model=name))
                    if name in BENCH_MODELS
                    else materialize(name, root=root)
                )
                model = load_causal_lm(str(folder)).eval().to(args.device)
                if (reason := FastDecoder.unsupported_reason(model, 1024)) is not None:
                    print(f"{name:12s} no fast path: {reason}")
                    continue
                for shape in args.shapes.split(","):
                    n_rows, new_tokens = (int(v) for v in shape.split("x"))
                    rows = prompts(n_rows, lengths, args.group)
                    times = {True: [], False: []}
                    tokens = {}
                    for fast in (True, False):  # warm-up
                        _, tokens[fast] = run(model, rows, new_tokens, fast, args.vs)
                    for _ in range(args.repeats):
                        for fast in (True, False):
                            times[fast].append(run(model, rows, new_tokens, fast, args.vs)[0])
                    hf, fa = statistics.median(times[False]), statistics.median(times[True])
                    print(
                        f"{name:12s} {shape:>7s} {hf * 1e3:8.1f}ms {fa * 1e3:10.1f}ms "
                        f"{min(times[False]) * 1e3:6.1f}ms {min(times[True]) * 1e3:7.1f}ms "
                        f"{hf / fa:7.2f}x  {torch.equal(tokens[True], tokens[False])}"
                    )
    finally:
        if saved is None:
            os.environ.pop(FAST_DECODE_ENV, None)
        else:
            os.environ[FAST_DECODE_ENV] = saved


if __name__ == "__main__":
    main()
