"""A micro-batch's sequences packed into one row for the CPU training forward: no padding computed.

A micro-batch is (B, P + T): prompts left-padded to P, completions right-padded to T. Its padded forward
computes every position, padding included (the `small` benchmark's steps: a third of the positions),
and on a CPU the time of a forward is its positions' matmuls. Packed, the rows' attended
tokens are laid end to end as one sequence of `total` tokens, each row's positions counted from 0
again; the model is called once on it with:

* the packed ``position_ids`` (RoPE at each row's own positions);
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (flash-attention's names):
  the fused CPU attention (``fusedlayers.attention``) attends within each sequence
  (``packedattention.packed_attention``, one C pass each way over the packed row), its cost that of the
  rows' own lengths, not of ``total`` (a module's own forward: through ``packedattention.packed_mask``);
* an attention mask that Hugging Face passes on as it is (``Packed.mask_placeholder``), so that no
  (total x total) mask is built;
* ``logits_to_keep`` the positions that predict a completion token, so the fused log-prob head
  (``loghead.LogprobHead``) sees only those.

The per-token results come back as (B, T): zero past a row's last attended token (its values there were
meaningless before too; callers mask them). Used by ``logprobs.sequence_logprobs`` where ``applies``: the
model runs the fused CPU layers and head; each row's attended tokens are one run that starts in the prompt;
no EOS is held back for ``min_new_tokens`` (its early positions are counted per row); no MoE router
logits are asked for (their load-balancing loss reads the attention mask).

The results equal the padded forward's to rounding (the matmuls see other row counts): within 2e-6,
gradients too (tested). Micro-batches need no cutting by length when packed (``rl/batch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpufleet.engine.fusedlayers import fused_layers, packs
from gpufleet.engine.loghead import CHUNK_ELEMENTS, LogprobHead, causal_lm, fused_head
from gpufleet.engine.switches import FUSED_LOGPROBS, PACKED, switched_off

__all__ = ["Packed", "applies", "logprobs", "pack", "saves_over", "unpack"]


@dataclass(frozen=True)
class Packed:
    """A micro-batch packed into one row (see the module docstring)."""

    input_ids: torch.Tensor  # (1, total)
    position_ids: torch.Tensor  # (1, total): each row's positions from 0
    cu_seq_lens: torch.Tensor  # (B + 1,) int32: where each row starts in the packed row, then total
    max_length: int  # the longest row's tokens
    kept: torch.Tensor  # (K,): the packed positions whose hidden states predict a completion token
    targets: torch.Tensor  # (1, K): the completion tokens they predict
    where: torch.Tensor  # (K,): where each goes in the (B, T) result, row * T + column

    def mask_placeholder(self) -> torch.Tensor:
        """What the model gets as its attention mask: (1, 1, total, total) hiding every key, a view of one
        boolean. Hugging Face passes a 4-D mask to the layers as it is, so no (total x total) mask is
        built; the fused attention attends by ``cu_seq_lens`` instead. An attention that used it would
        see no key at all (SDPA gives zeros there): ``applies`` packs only where the fused attention runs
        every attention module (``fusedlayers.packs``) and nothing else reads the mask."""
        total = self.input_ids.shape[1]
        return torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=self.input_ids.device).expand(
            1, 1, total, total
        )

    def forward_kwargs(self) -> dict:
        """The model's keyword arguments for the packed forward (with ``use_cache=False``)."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.mask_placeholder(),
            "position_ids": self.position_ids,
            "use_cache": False,
            "logits_to_keep": self.kept,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def applies(model: torch.nn.Module, eos_token_id: int | None, min_new_tokens: int) -> bool:
    """Whether ``logprobs.sequence_logprobs`` packs for ``model``: the fused CPU layers run every attention
    module (``fusedlayers.packs``), the fused head applies, no EOS is held back for ``min_new_tokens``, no
    MoE router logits are asked for, and neither ``GPUFLEET_PACKED`` nor ``GPUFLEET_FUSED_LOGPROBS`` is 0."""
    lm = causal_lm(model)
    return (
        (eos_token_id is None or min_new_tokens <= 0)
        and not switched_off(PACKED)
        and not switched_off(FUSED_LOGPROBS)
        and lm is not None
        and not getattr(lm.config, "output_router_logits", False)  # MoE: the aux loss reads the mask
        and packs(model)
    )


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_start: int) -> Packed | None:
    """``input_ids`` (B, P + T) packed; None where a row's attended tokens are not one run that starts
    before ``completion_start`` (nothing to predict its first completion token from), or where no row has
    an attended completion token."""
    attended = attention_mask > 0
    batch, width = attended.shape
    counts = attended.sum(dim=1)
    first = attended.int().argmax(dim=1)
    last = width - 1 - attended.flip(1).int().argmax(dim=1)
    predicting = (last - completion_start + 1).clamp(min=0)  # per row: completion tokens predicted
    if bool(((counts == 0) | (first >= completion_start) | (last - first + 1 != counts)).any()) or not bool(
        predicting.any()
    ):
        return (
            None  # a row without a prompt token or with a second run of attended tokens; nothing to predict
        )
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = counts.cumsum(0)
    steps = width - completion_start
    # the predicting positions of row b: completion_start - 1 .. last - 1 (the padded row's columns)
    rows = torch.repeat_interleave(torch.arange(batch, device=input_ids.device), predicting)
    column = torch.arange(int(predicting.sum()), device=input_ids.device) - torch.repeat_interleave(
        predicting.cumsum(0) - predicting, predicting
    )
    kept = cu[:-1].long()[rows] + (completion_start - 1 - first[rows]) + column
    return Packed(
        input_ids=input_ids[attended].unsqueeze(0),
        position_ids=(attended.long().cumsum(dim=1) - 1)[attended].unsqueeze(0),
        cu_seq_lens=cu,
        max_length=int(counts.max()),
        kept=kept,
        targets=input_ids[rows, completion_start + column].unsqueeze(0),
        where=rows * steps + column,
    )


def unpack(values: torch.Tensor, packed: Packed, batch: int, steps: int) -> torch.Tensor:
    """(K,) per-token ``values`` of the packed forward as (B, T), zero where nothing was predicted."""
    out = values.new_zeros(batch * steps)
    return out.index_put((packed.where,), values).view(batch, steps)


def saves_over(attention_mask: torch.Tensor, over: int) -> bool:
    """Whether packing the rows computes more than ``over`` fewer positions than their padded forward.
    Checked first: ``applies`` walks the model's modules and ``pack`` builds the layout, both for nothing
    where there is too little padding to pack (the tiny built-in model's micro-batches)."""
    return attention_mask.numel() - int(attention_mask.count_nonzero()) > over


def logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_start: int,
    settings: tuple,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``logprobs.sequence_logprobs`` by a packed forward: per-token log-probs and entropies (B, T), or None
    where the rows do not pack (``pack``). ``settings``: (temperature, suppress_tokens, EOS id,
    min_new_tokens, entropy); the caller checked ``applies`` and ``saves_over``."""
    packed = pack(input_ids, attention_mask, completion_start)
    if packed is None:
        return None
    lm = causal_lm(model)
    size = chunk or max(1, CHUNK_ELEMENTS // max(1, lm.config.vocab_size))

    def head(original: torch.nn.Module, softcap: float | None) -> LogprobHead:
        return LogprobHead(original, packed.targets, size, softcap, settings, drop_last=False)

    with fused_head(lm, head), fused_layers(model):
        stats = model(**packed.forward_kwargs()).logits[0]  # (K, 2)
    batch, steps = input_ids.shape[0], input_ids.shape[1] - completion_start
    entropy = unpack(stats[:, 1], packed, batch, steps) if stats.shape[1] > 1 else None
    return unpack(stats[:, 0], packed, batch, steps), entropy
