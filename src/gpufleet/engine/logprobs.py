"""The per-token log-probs and entropies of sampled completions under a model, for training: the
policy's (with gradients), the old and the reference log-probs.

``sequence_logprobs`` asks the model for the completion's positions only (``logits_to_keep``) and, for
the usual decoder classes, swaps the model's output head for ``loghead.LogprobHead`` during the call:
the head's logits and the float32 temporaries over the vocabulary exist for one chunk of positions at a
time, recomputed in backward. Other models give their completion logits whole, then chunked statistics.
On a CPU with the fused layers a micro-batch's rows are packed into one sequence first (``packing``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpufleet.engine import packing
from gpufleet.engine.fusedlayers import fused_layers
from gpufleet.engine.loghead import CHUNK_ELEMENTS, LogprobHead, causal_lm, chunked_stats, fused_head
from gpufleet.engine.switches import FUSED_LOGPROBS, switched_off

__all__ = ["sequence_logprobs"]

_CHUNK_ELEMENTS = CHUNK_ELEMENTS


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_start: int,
    *,
    temperature: float = 1.0,
    chunk: int | None = None,
    suppress_tokens: Sequence[int] = (),
    min_new_tokens: int = 0,
    eos_token_id: int | None = None,
    pack_over: int | None = 0,
    entropy: bool = True,
    router: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs and entropies (both (B, T), float32) of ``input_ids[:, completion_start:]``;
    with ``entropy=False`` (TRL's ``compute_entropy=False``, for the no-grad old and reference passes) the
    entropies are None and not computed, the log-probs the same bits.

    Logits are divided by ``temperature`` first (as TRL does, so they match the sampling distribution);
    the ``suppress_tokens`` get probability 0, and ``eos_token_id`` before ``min_new_tokens``, as in ``generate``.
    Gradients flow into the log-probs when called with grad enabled; the entropy is for metrics and
    carries a gradient too. ``model`` is called once as a whole (so DDP/FSDP wrappers work) with
    ``logits_to_keep`` covering only the completion. For the models of ``loghead.FUSED_CLASSES`` its
    head is ``loghead.LogprobHead`` during the call: logits exist ``chunk`` positions at a time only
    (default: about 16M logits per chunk), each chunk recomputed in backward; for other models (or with
    ``GPUFLEET_FUSED_LOGPROBS=0``) the completion's logits are made whole and the statistics taken in chunks.
    On a CPU with the fused layers the rows are packed into one sequence first (``packing``: no padding
    computed; zero past a row's last attended token) where that computes more than ``pack_over`` fewer
    positions (None: never). Values at masked positions are computed but meaningless; the caller
    applies the mask.
    """
    batch, length = input_ids.shape
    steps = length - completion_start
    if not 0 < completion_start < length:
        raise ValueError(f"completion_start must be in [1, {length - 1}], got {completion_start}")
    positions = (attention_mask.long().cumsum(dim=1) - 1).clamp_(min=0)
    targets = input_ids[:, completion_start:]
    settings = (temperature, tuple(suppress_tokens), eos_token_id, min_new_tokens, entropy)
    if (
        pack_over is not None
        and router is None
        and packing.saves_over(attention_mask, pack_over)
        and packing.applies(model, eos_token_id, min_new_tokens)
    ):
        packed = packing.logprobs(model, input_ids, attention_mask, completion_start, settings, chunk)
        if packed is not None:
            return packed

    routed = {} if router is None else {"output_router_logits": True}

    def forward() -> torch.Tensor:
        with fused_layers(model):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=steps + 1,
                **routed,
            )
        if router is not None:
            router.append(out.router_logits)
        return out.logits

    lm = causal_lm(model) if not switched_off(FUSED_LOGPROBS) else None
    if lm is not None:
        size = chunk or max(1, _CHUNK_ELEMENTS // max(1, batch * lm.config.vocab_size))

        def head(original: torch.nn.Module, softcap: float | None) -> LogprobHead:
            return LogprobHead(original, targets, size, softcap, settings)

        with fused_head(lm, head):
            stats = forward()
        return stats[..., 0], stats[..., 1] if entropy else None
    logits = forward()[:, :-1]
    size = chunk or max(1, _CHUNK_ELEMENTS // max(1, batch * logits.shape[-1]))
    return chunked_stats(lambda x: x, logits, targets, size, settings)
