"""Per-token log-probs and entropies straight from the hidden states: the output head applied chunk by
chunk, so no (batch, tokens, vocab) logits exist for the whole batch, in fp32 or in the compute dtype.

``LogprobHead`` stands in for a causal LM's ``lm_head`` for the length of one forward call
(``fused_head``): the model is still called as a whole, so DDP's and FSDP2's hooks fire as before (FSDP2's
root unit holds the head and keeps it gathered from forward to the end of backward; DDP sees the head's
weight used in the graph). The model's forward slices the hidden states to the kept positions and
calls its head on them; ``LogprobHead`` then computes, ``chunk`` positions at a time, the head's logits,
Gemma2/3's final soft-capping (switched off in the model's config meanwhile and applied here, in the
same order of operations), the temperature, the suppressed tokens and the per-token statistics, each
chunk under ``torch.utils.checkpoint`` when gradients are wanted, so backward recomputes one chunk's
logits at a time. It returns (B, T, 2): log-prob and entropy ((B, T, 1) when no entropy is asked for),
which the model's forward returns as its ``logits``. The head module itself is called on each chunk, so a
LoRA-wrapped or tied head works alike; a plain bias-free ``nn.Linear`` head with gradients and no
autocast is applied as ``F.linear`` with its weight by ``_SummedHead`` instead, which recomputes the
chunks itself and sums the weight's gradient over them in one buffer (autograd's own sum holds three
vocab x hidden at once).

Only model classes whose forward does nothing to the logits after the head but soft-capping are
listed in ``FUSED_CLASSES``; any other model takes the plain path in ``logprobs.sequence_logprobs``
(full logits of the completion, statistics in chunks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gpufleet.engine.sampling import suppress_early, suppress_logits

__all__ = ["FUSED_CLASSES", "CHUNK_ELEMENTS", "LogprobHead", "causal_lm", "fused_head", "token_stats"]

CHUNK_ELEMENTS = 1 << 24
"""Default chunk of the log-prob statistics: about this many (batch x time x vocab) logits at once."""

FUSED_CLASSES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "Olmo2ForCausalLM",
    }
)
"""Causal LMs whose forward ends in ``logits = self.lm_head(hidden)`` plus, for Gemma2/3, the
``final_logit_softcapping`` of their config (checked against transformers 5.23's modeling code)."""


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    suppress_tokens: Sequence[int] = (),
    early: tuple[int | None, int, int] = (None, 0, 0),
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` (B, C) and entropy under ``logits`` (B, C, V) / temperature, in float32,
    with the ``suppress_tokens`` at probability 0 (where a target is one, padding after EOS, its log-prob is 0)
    and ``early`` = (EOS id, first position of the chunk, min_new_tokens): EOS at probability 0 before it.
    With ``entropy=False`` the entropy is None (TRL's ``compute_entropy=False``: a softmax, a product and a
    sum over the vocabulary fewer; the log-prob is the same bits)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logits = suppress_early(suppress_logits(logits, suppress_tokens), *early)
    log_z = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    if entropy:
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    else:
        entropy = None
    if suppress_tokens:  # padding after EOS: masked by the caller, kept finite here
        logp = logp.masked_fill(
            torch.isin(targets, torch.tensor(list(suppress_tokens), device=targets.device)), 0.0
        )
    return logp, entropy


def sampled_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    suppress_tokens: Sequence[int],
    early: tuple[int | None, int, int],
) -> torch.Tensor:
    """(B,) log-probs of the ``tokens`` (B,) one decode step sampled from ``logits`` (B, V), as
    ``token_stats`` defines them (the trainer's log-probs of those tokens); ``early`` = (EOS id, the step,
    min_new_tokens). What ``generate(..., logprobs=True)`` records while decoding."""
    logp, _ = token_stats(
        logits[:, None], tokens[:, None], temperature, suppress_tokens, early, entropy=False
    )
    return logp[:, 0]


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, start: int, settings: tuple
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_stats`` of one chunk whose first position is ``start``. ``settings``: (temperature,
    suppress_tokens, eos_token_id, min_new_tokens, entropy); entropy False: None for the entropies."""
    temperature, suppress, eos, min_new, with_entropy = settings
    return token_stats(logits, targets, temperature, suppress, (eos, start, min_new), with_entropy)


def stacked(logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    """(..., 2): log-prob and entropy, or (..., 1) without entropies (what ``LogprobHead`` returns)."""
    return torch.stack([logp] if entropy is None else [logp, entropy], dim=-1)


def chunked_stats(
    logits_of, source: torch.Tensor, targets: torch.Tensor, chunk: int, settings: tuple
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_stats`` over ``chunk`` positions of ``source`` at a time (``logits_of(piece)`` -> logits),
    each chunk recomputed in backward when ``source`` carries a gradient."""

    def stats(
        piece: torch.Tensor, target: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return chunk_stats(logits_of(piece), target, start, settings)

    recompute = torch.is_grad_enabled() and source.requires_grad
    logps, entropies = [], []
    for start in range(0, targets.shape[1], chunk):
        piece = (source[:, start : start + chunk], targets[:, start : start + chunk], start)
        logp, entropy = checkpoint(stats, *piece, use_reentrant=False) if recompute else stats(*piece)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps, dim=1), torch.cat(entropies, dim=1) if settings[4] else None


class LogprobHead(torch.nn.Module):
    """The output head turned into per-token (log-prob, entropy) of ``targets`` (see the module docstring).

    Called on the hidden states of the T + 1 kept positions (B, T + 1, H); the last one predicts nothing
    in ``targets`` and is dropped (with ``drop_last=False``, on T positions: a packed forward's, which
    keeps only the predicting ones). Returns (B, T, 2) float32, or (B, T, 1) without entropies."""

    def __init__(
        self,
        head: torch.nn.Module,
        targets: torch.Tensor,
        chunk: int,
        softcap: float | None,
        settings: tuple,
        drop_last: bool = True,
    ):
        super().__init__()
        self.head = head
        self.targets, self.chunk, self.softcap, self.settings = targets, chunk, softcap, settings
        self.drop_last = drop_last

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._capped(self.head(hidden))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:  # as Gemma2ForCausalLM.forward does it
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        source = hidden[:, :-1] if self.drop_last else hidden
        head = self.head
        if (
            torch.is_grad_enabled()
            and type(head) is torch.nn.Linear
            and head.bias is None
            and head.weight.requires_grad
            and not torch.is_autocast_enabled(hidden.device.type)
        ):
            return _SummedHead.apply(source, head.weight, self)
        return stacked(*chunked_stats(self.logits, source, self.targets, self.chunk, self.settings))


class _SummedHead(torch.autograd.Function):
    """``LogprobHead.forward`` for a bias-free ``nn.Linear`` head with gradients, no autocast: the same
    chunks, each recomputed in backward, but the head weight's gradient summed in one (vocab x hidden)
    buffer (``addmm_``) instead of autograd's: there each chunk's gradient meets the running sum and the
    first sum is made out of place, three vocab x hidden at once (1.52 GiB for Qwen2.5-0.5B in fp32).
    The weight's gradient reaches it once, through autograd as any other (DDP's and FSDP2's hooks)."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, weight: torch.Tensor, head: LogprobHead) -> torch.Tensor:
        ctx.save_for_backward(source, weight)
        ctx.head = head
        with torch.no_grad():
            return stacked(
                *chunked_stats(
                    lambda x: head._capped(F.linear(x, weight)),
                    source,
                    head.targets,
                    head.chunk,
                    head.settings,
                )
            )

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, None]:
        source, weight = ctx.saved_tensors
        head = ctx.head
        d_source = torch.empty_like(source) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight)
        for start in range(0, source.shape[1], head.chunk):
            end = start + head.chunk
            piece = source[:, start:end]
            raw = F.linear(piece, weight).requires_grad_()  # backward runs without grad: a fresh leaf
            with torch.enable_grad():
                stats = stacked(
                    *chunk_stats(head._capped(raw), head.targets[:, start:end], start, head.settings)
                )
                (d_raw,) = torch.autograd.grad(stats, raw, grad[:, start:end])
            d_weight.addmm_(d_raw.flatten(0, -2).t(), piece.flatten(0, -2))
            if d_source is not None:
                d_source[:, start:end] = d_raw @ weight
        return d_source, d_weight, None


def causal_lm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The causal LM inside ``model`` (itself, or inside DDP / peft wrappers) if its class is in
    ``FUSED_CLASSES``, else None."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if "lm_head" in module._modules:
            name = type(module).__name__
            if isinstance(module, FSDPModule):  # fully_shard makes the class FSDP<name>
                name = name.removeprefix("FSDP")
            return module if name in FUSED_CLASSES else None
    return None


@contextlib.contextmanager
def fused_head(lm: torch.nn.Module, make_head) -> Iterator[None]:
    """For the length of the block, ``lm.lm_head`` is ``make_head(lm.lm_head, softcap)`` and the
    config's ``final_logit_softcapping`` (if any) is None; both are restored after."""
    original = lm.lm_head
    config = lm.config
    softcap = getattr(config, "final_logit_softcapping", None)
    lm._modules["lm_head"] = make_head(original, softcap)
    if softcap is not None:
        config.final_logit_softcapping = None
    try:
        yield
    finally:
        lm._modules["lm_head"] = original
        if softcap is not None:
            config.final_logit_softcapping = softcap
