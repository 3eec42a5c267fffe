"""The policy's next-token distribution: which tokens it never holds, per-row uniforms, inverse-CDF picks.

**Tokens never sampled.** A pad token that is not an EOS is no answer a model should give: it decodes to
no text (``skip_special_tokens``), so "kkkkkkkk<pad><pad>" reads "kkkkkkkk", as if the model had
stopped, and a reward on the text (its length, whether it stopped) pays for pads instead of EOS. At
random init (the built-in models) pad is as live as any token, and a run learns that trick within a
few dozen steps (see ``tasks/repeat.py``). ``never_sampled`` names these tokens once, from the
tokenizer and the model's config (``parts.build``); ``suppress_logits`` gives them probability exactly 0.

The policy is then the distribution *without* them, everywhere: sampling (``rollout.generate``), the
trained log-probs, the old log-probs and the reference's (``logprobs.sequence_logprobs``), so the
importance ratio and the KL compare the distribution that was sampled. Suppressing in sampling alone is
not enough: pad, never sampled, would never be pushed down either, and soaks up the probability mass
(entropy 2.4 -> 0.05 by step 70 on the quickstart). Hugging Face's ``generate`` does the same with
``generation_config.suppress_tokens`` (TRL passes such settings through its generation config); the
saved model carries that setting, so ``from_pretrained(...).generate`` samples what was trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from gpufleet.engine import cpu_kernels

__all__ = [
    "never_sampled",
    "suppress_logits",
    "suppress_early",
    "row_uniforms",
    "next_tokens",
    "pick",
    "cumulative",
    "search_chunks",
]


def never_sampled(
    pad_token_id: int | None, eos_token_ids: Iterable[int | list[int] | None]
) -> tuple[int, ...]:
    """The token ids the policy never samples: ``(pad,)`` when there is a pad token and it is none of
    ``eos_token_ids`` (each an id, a list of ids, or None: the tokenizer's, the config's, ...), else ``()``.

    >>> never_sampled(0, [1, None]), never_sampled(2, [[1, 2]]), never_sampled(None, [1])
    ((0,), (), ())
    """
    eos: set[int] = set()
    for ids in eos_token_ids:
        eos |= set(ids) if isinstance(ids, list | tuple) else {ids} if ids is not None else set()
    return () if pad_token_id is None or pad_token_id in eos else (int(pad_token_id),)


def mark_generation_config(tokenizer, model, min_new_tokens: int = 0) -> tuple[int, ...]:
    """The tokens ``model`` never samples (``never_sampled``: the tokenizer's pad, against every EOS the
    tokenizer, config and generation config name), written into its generation config (``suppress_tokens``,
    and ``min_new_tokens``: rollout.min_completion_length), so a saved model's ``generate`` samples as
    training did."""
    generation = getattr(model, "generation_config", None)
    eos = [tokenizer.eos_token_id, model.config.eos_token_id, getattr(generation, "eos_token_id", None)]
    tokens = never_sampled(tokenizer.pad_token_id, eos)
    if generation is not None:
        generation.suppress_tokens = list(tokens) or None
        generation.min_new_tokens = min_new_tokens or None
    return tokens


def suppress_logits(logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``logits`` (..., V) with the ``token_ids`` columns at the dtype's lowest finite value: after any
    softmax their probability is exactly 0, while ``p * logit`` stays 0 (not NaN), so the entropy stays
    finite, and no gradient reaches them. ``()`` returns ``logits`` itself. ``token_ids`` may be a long
    tensor on the logits' device (made once by a caller that suppresses at every step)."""
    if len(token_ids) == 0:
        return logits
    index = (
        token_ids
        if isinstance(token_ids, torch.Tensor)
        else torch.tensor(list(token_ids), device=logits.device)
    )
    return logits.index_fill(-1, index, torch.finfo(logits.dtype).min)


def suppress_early(logits: torch.Tensor, eos_token_id: int | None, first: int, count: int) -> torch.Tensor:
    """``logits`` (B, C, V) of completion positions ``first .. first + C - 1`` with ``eos_token_id`` at
    probability 0 at positions below ``count`` (``rollout.min_completion_length``; HF's
    ``min_new_tokens``). Nothing to do (``count <= first`` or no EOS) returns ``logits`` itself."""
    early = min(count - first, logits.shape[-2])
    if eos_token_id is None or early <= 0:
        return logits
    head = suppress_logits(logits[..., :early, :], (int(eos_token_id),))
    return torch.cat([head, logits[..., early:, :]], dim=-2)


def row_uniforms(seeds: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """(B, steps) uniforms in [0, 1); row i comes from its own generator seeded with seeds[i].

    Drawn in float32 and widened to float64 so that ``u * total`` stays strictly below ``total``.
    """
    out = torch.empty((len(seeds), steps), dtype=torch.float32)
    for i, seed in enumerate(seeds):
        out[i] = torch.rand(steps, generator=torch.Generator().manual_seed(int(seed)))
    return out.to(device=device, dtype=torch.float64)


def plain(temperature: float, top_p: float, top_k: int) -> bool:
    """Sampling with a temperature and neither top-k nor top-p: what the C sampler takes."""
    return temperature > 0 and top_k == 0 and top_p >= 1.0


def native_probs(logits: torch.Tensor, suppress: torch.Tensor, temperature: float) -> torch.Tensor:
    """The probabilities (B, V) of float32 CPU ``logits`` (overwritten in place when contiguous) with the
    ``suppress`` columns at 0 and the temperature applied in C (``gpufleet_sample_prepare``), then
    ``torch.softmax``: the bits ``next_tokens`` samples from."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    cpu_kernels.library().gpufleet_sample_prepare(
        logits.data_ptr(), rows, vocab, suppress.data_ptr(), len(suppress), temperature
    )
    return torch.softmax(logits, dim=-1)


def pick(
    logits: torch.Tensor,
    suppress: torch.Tensor,
    uniforms: torch.Tensor | None,
    temperature: float,
    top_p: float,
    top_k: int,
) -> torch.Tensor:
    """Next tokens (B,) of one decode step: ``next_tokens`` of the logits (B, V) with the ``suppress``
    columns (a long tensor, maybe empty) at probability 0. ``logits`` may be overwritten.

    On the CPU, for float32 logits sampled without top-k / top-p, the steps around the softmax run in C
    (``cpu_kernels``: suppressing and the temperature before it, the float64 running sum and the search
    after it) and give the same tokens bit for bit (tested), in about a third of the time of those
    torch ops for the decode of a small model."""
    native = (
        plain(temperature, top_p, top_k)
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and cpu_kernels.available()
    )
    if not native:
        if logits.is_cuda and len(suppress):  # in place: a copy of (B, V) logits costs a GPU step 2 passes
            logits.index_fill_(-1, suppress, torch.finfo(logits.dtype).min)
            return next_tokens(logits, uniforms, temperature, top_p, top_k)
        return next_tokens(suppress_logits(logits, suppress), uniforms, temperature, top_p, top_k)
    probs = native_probs(logits, suppress, temperature)
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.long)
    cpu_kernels.library().gpufleet_sample_pick(
        probs.data_ptr(), rows, vocab, uniforms.data_ptr(), uniforms.stride(0), out.data_ptr()
    )
    return out


def next_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float, top_p: float, top_k: int
) -> torch.Tensor:
    """Next tokens (B,) from last-position logits (B, V): greedy if temperature == 0, else inverse CDF."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature  # x / 1 is x
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if probs.is_cuda and vocab > 4 * _SCAN_CHUNK:
        return search_chunks(probs, uniforms)
    cdf = cumulative(probs)
    # First index whose CDF exceeds u * total: a token of probability 0 can never be picked.
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)


_SCAN_CHUNK = 1024


def search_chunks(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``next_tokens``'s inverse-CDF pick (B,) from ``probs`` (B, V) in two levels, for long rows on a GPU:
    the float64 sums of chunks of ``_SCAN_CHUNK`` probabilities and their running total find the chunk
    where the CDF passes ``u * total``, then a scan of that chunk alone finds the token. The
    probabilities are read once (a full float64 scan, ``cumulative``, writes and reads V float64 per row
    several times: 0.7 ms of a decode step at 256 rows of a 151,936-token vocabulary). The sums associate
    differently from a full scan (within float64 ulps). A token of probability 0 is never picked: the
    first index whose running sum exceeds the target, else (rounding at the chunk's end) the chunk's last
    token of positive probability."""
    rows, vocab = probs.shape
    whole = vocab - vocab % _SCAN_CHUNK
    sums = probs[:, :whole].view(rows, -1, _SCAN_CHUNK).sum(dim=-1, dtype=torch.float64)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=1)
    ends = sums.cumsum(dim=-1)  # (B, chunks): the CDF at each chunk's end
    target = (uniforms * ends[:, -1]).unsqueeze(-1)
    chunk = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)  # (B, 1)
    before = torch.where(chunk > 0, ends.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    index = chunk * _SCAN_CHUNK + torch.arange(_SCAN_CHUNK, device=probs.device)
    inside = index < vocab
    values = probs.gather(1, index.clamp_(max=vocab - 1)).double().mul_(inside)
    found = torch.searchsorted(values.cumsum(dim=-1).add_(before), target, right=True)
    positive = torch.arange(_SCAN_CHUNK, device=probs.device).mul(values > 0).amax(dim=-1, keepdim=True)
    return (chunk * _SCAN_CHUNK + torch.minimum(found, positive)).squeeze(-1)


def cumulative(probs: torch.Tensor, chunked: bool | None = None) -> torch.Tensor:
    """The float64 cumulative sums of ``probs`` (B, V) over V, possibly followed by padding columns that
    repeat the total (searching it finds the same index).

    On a GPU (``chunked`` None: when ``probs`` is on CUDA and V > 4 chunks) the rows are scanned in chunks of
    ``_SCAN_CHUNK`` and each chunk offset by the sum of the chunks before it: CUDA scans a few long rows
    with one thread block each (258 us for 16 x 151,936 on an H200, more than the rest of a decode
    step's sampling), the chunks with all of them. The sums associate differently (as any parallel scan
    does), within a few float64 ulps."""
    p = probs.double()
    rows, vocab = p.shape
    if chunked is None:
        chunked = p.is_cuda and vocab > 4 * _SCAN_CHUNK
    if not chunked:
        return p.cumsum(dim=-1)
    chunks = torch.nn.functional.pad(p, (0, -vocab % _SCAN_CHUNK)).view(rows, -1, _SCAN_CHUNK).cumsum(dim=-1)
    offsets = torch.nn.functional.pad(chunks[..., -1].cumsum(dim=-1)[..., :-1], (1, 0))
    return (chunks + offsets[..., None]).view(rows, -1)
