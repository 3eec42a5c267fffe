"""`train.torch_compile`: each decoder layer compiled with torch.compile, the rest eager.

Regional compilation, as torchtitan and accelerate do it: the blocks of a decoder are the same code, so
one compile (TorchInductor, dynamic shapes: the batch and the sequence length stay symbolic) serves every
layer of the policy at every length; the reference's forward (no gradient) adds one more. What is around
the layers (embeddings, attention masks, the chunked log-prob head) stays eager, and so does generation:
the decode loop runs under ``torch.compiler.set_stance("force_eager")`` (its shapes change every token;
the fast decoder does not call the layers at all). Under FSDP2 the layers are compiled before
``fully_shard`` wraps them, torchtitan's order.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from gpufleet.errors import UserError
from gpufleet.parallel import decoder_layers


def compile_layers(model: torch.nn.Module) -> None:
    """Compile every decoder layer of `model` in place (``nn.Module.compile``); a model whose layers cannot
    be found is a UserError naming train.torch_compile."""
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        raise UserError(str(e), field="train.torch_compile", fix="--set train.torch_compile=false") from None
    for layer in layers:
        layer.compile(dynamic=True)


def eager(compiled: bool) -> AbstractContextManager:
    """A context in which compiled layers run eagerly (generation), or nothing to do."""
    return torch.compiler.set_stance("force_eager") if compiled else nullcontext()
