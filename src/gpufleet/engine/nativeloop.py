"""The CPU decode loop with its per-step bookkeeping in C (``gpufleet_sample_advance`` in engine/cpu_kernels.c).

``decodeloop.loop`` runs each step as a dozen small torch operations around the model (the pad for
finished rows, the token and mask columns, the done flags, the count of live rows, the rows the decoder
still runs): on the ``small`` benchmark about a fifth of a rollout's CPU time went there and to the
sampler's calls, next to the C decode step. Here a step is the C decode step, the sampler's C
preparation, ``torch.softmax`` (kept: the tokens are those of ``sampling.pick``, bit for bit) and one C
call that picks each live row's token and does the bookkeeping; the mask is made once at the end from
the step each row finished at. Used for the fast decoder's C step (``FastDecoder.native``) when
sampling with a temperature and neither top-k nor top-p, and no ``all_done`` collective; the rollout is
the one ``decodeloop.loop`` makes otherwise, bit for bit (tested).
"""

from __future__ import annotations

import torch

from gpufleet.engine import cpu_kernels
from gpufleet.engine.fastdecode import FastDecoder
from gpufleet.engine.sampling import native_probs, plain

__all__ = ["applies", "decode"]


def applies(decoder: FastDecoder | None, temperature: float, top_p: float, top_k: int, all_done) -> bool:
    """Whether ``decode`` runs this rollout: the C decode step, plain sampling, no collective."""
    return (
        decoder is not None
        and decoder.native is not None
        and plain(temperature, top_p, top_k)
        and all_done is None
    )


_TINY = torch.finfo(torch.float32).tiny


def decode(
    decoder: FastDecoder,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    uniforms: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float,
    suppress: tuple[torch.Tensor, torch.Tensor],
    min_new_tokens: int,
    drop_fraction: float,
    record: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids, completion mask), each (B, steps): the tokens of ``decodeloop.loop``.

    ``suppress``: the ids never sampled, and those before ``min_new_tokens`` (EOS added). Finished rows
    leave the decoder once ``drop_fraction`` of the rows it runs are done. ``record`` (B, max_new_tokens):
    filled with each sampled token's log-prob, the log of the probability it was sampled with (the trainer's
    definition, ``loghead.sampled_logprobs``, within rounding)."""
    lib = cpu_kernels.library()
    batch = prompt.shape[0]
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp_(min=0)
    logits = decoder.prefill(prompt, prompt_mask, positions, max_new_tokens)
    rows = torch.arange(batch)  # decoder row i is batch row rows[i]
    token = torch.empty(batch, dtype=torch.long)
    position = prompt_mask.sum(dim=1)  # of the token fed next
    done = torch.zeros(batch, dtype=torch.uint8)
    finish = torch.full((batch,), max_new_tokens, dtype=torch.long)  # the step a row picked EOS at
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long)
    live, steps = batch, 0
    for t in range(max_new_tokens):
        if t > 0:
            if decoder.graph is None and live <= (1 - drop_fraction) * len(rows):  # a graph runs every row
                keep = (done[rows] == 0).nonzero().squeeze(1)
                decoder.keep(keep)
                rows, token, position = rows[keep], token[keep], position[keep]
            logits = decoder.step(token, position)
        probs = native_probs(logits, suppress[1] if t < min_new_tokens else suppress[0], temperature)
        n, vocab = probs.shape
        column = uniforms[:, t]
        live = lib.gpufleet_sample_advance(
            probs.data_ptr(),
            n,
            vocab,
            column.data_ptr(),
            column.stride(0),
            rows.data_ptr(),
            t,
            eos_token_id,
            pad_token_id,
            out.data_ptr(),
            out.stride(0),
            done.data_ptr(),
            finish.data_ptr(),
            token.data_ptr(),
            position.data_ptr(),
        )
        if (
            record is not None
        ):  # log of the probabilities sampled from (0 at a finished row's pad: kept finite)
            record[rows, t] = probs.gather(1, token[:n, None]).squeeze(1).clamp_(min=_TINY).log_()
        steps = t + 1
        if live == 0:
            break
    mask = (torch.arange(steps)[None, :] <= finish[:, None]).long()
    return out[:, :steps].clone(), mask
