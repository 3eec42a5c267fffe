"""One no-grad log-prob pass (the reference / old log-probs of a step) with and without the entropy.

    python3 bench/logprob_pass.py --device cuda                      # Qwen2.5-0.5B's shapes, 16 x 74 and 8 x 1,024
    .venv/bin/python bench/logprob_pass.py --preset small --shapes 16x10+64 --repeats 5

``sequence_logprobs(..., entropy=False)`` (TRL's ``compute_entropy=False``) skips a softmax, a product
and a sum over the vocabulary per chunk; the trainer's old and reference passes use it. For each shape
(rows x prompt + completion tokens, random ids, no padding) and precision (fp32, bf16 autocast over the
fp32 weights) the two calls alternate ``--repeats`` times; it prints best and median of each (wall time
between synchronisations on a GPU, CPU time on the CPU), the ratio of the medians, the peak memory on a
GPU and whether the log-probs are the same bits. No assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from measure import PRESETS, model_folder

from gpufleet.engine.logprobs import sequence_logprobs
from gpufleet.models import load_causal_lm


def shape(text: str) -> tuple[int, int, int]:
    rows, rest = text.split("x")
    prompt, completion = rest.split("+")
    return int(rows), int(prompt), int(completion)


def one_pass(model, ids: torch.Tensor, prompt: int, bf16: bool, entropy: bool) -> torch.Tensor:
    """The log-probs of one no-grad pass over `ids` (completion from `prompt` on)."""
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        mask = torch.ones_like(ids)
        return sequence_logprobs(model, ids, mask, prompt, entropy=entropy, pack_over=None)[0]


def compare(model, ids: torch.Tensor, prompt: int, bf16: bool, repeats: int) -> str:
    """One line: the pass with and without the entropy, alternating `repeats` times."""
    cuda = ids.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.process_time
    same = torch.equal(one_pass(model, ids, prompt, bf16, True), one_pass(model, ids, prompt, bf16, False))
    times: dict[bool, list[float]] = {True: [], False: []}
    peaks = dict.fromkeys((True, False), 0.0)
    for _ in range(repeats):
        for entropy in (True, False):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = clock()
            one_pass(model, ids, prompt, bf16, entropy)
            sync()
            times[entropy].append(clock() - start)
            if cuda:
                peaks[entropy] = torch.cuda.max_memory_allocated() / 2**20
    with_, without = (statistics.median(times[e]) for e in (True, False))
    return (
        f"with entropy best {min(times[True]) * 1e3:.2f} median {with_ * 1e3:.2f} ms; without best "
        f"{min(times[False]) * 1e3:.2f} median {without * 1e3:.2f} ms; ratio {without / with_:.3f}"
        + (f"; peak {peaks[True]:.0f} / {peaks[False]:.0f} MiB" if cuda else "")
        + f"; log-probs the same bits: {same}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--preset", default="gpu", choices=sorted(PRESETS), help="the model of this vs_trl.py preset"
    )
    ap.add_argument(
        "--shapes", default="16x10+64,8x64+960", help="rows x prompt + completion tokens, comma-separated"
    )
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_causal_lm(str(model_folder(PRESETS[a.preset]))).eval().to(a.device)
    vocab = model.config.vocab_size
    for rows, prompt, completion in map(shape, a.shapes.split(",")):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, vocab, (rows, prompt + completion), generator=g).to(a.device)
        for precision in ("fp32", "bf16"):
            line = compare(model, ids, prompt, precision == "bf16", a.repeats)
            print(
                f"{a.device} {precision} {rows}x{prompt}+{completion}, vocabulary {vocab}: {line}", flush=True
            )


if __name__ == "__main__":
    main()
