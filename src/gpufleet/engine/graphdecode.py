"""A ``FastDecoder`` decode step captured in a CUDA graph once per rollout and replayed for every token.

On a GPU a small model's decode step is bound by kernel launches, not arithmetic: for Qwen2.5-0.5B's
shapes (24 layers) the step is about 700 kernels, 5.6 us of host time each, while the GPU needs about
4.5 ms for all of them at 16 rows (bench/README.md, ``--preset gpu``). A CUDA graph records the
step's kernels once and launches them all with one call.

A graph replays fixed shapes and fixed addresses, so the captured step (``FastDecoder.layers_step``
with a tensor ``slot``) takes nothing from the host:

* the token, position and cache slot of each step are copied into buffers the graph reads;
* with ``gpuattention`` (the default on a GPU) its kernel writes the new keys and values to the slot
  and attends to each row's written keys (the slot read from a device tensor); without it:
* the new keys and values go to the slot through ``index_copy_``, and the attention runs over the
  whole preallocated cache (its unwritten slots zeroed once: a masked slot's weight is 0, and 0 times
  the NaN an uninitialised slot may hold is NaN), the decoder's key mask (-inf on every slot not
  written yet, and on the prompts' pads) opened at the slot inside the graph (``index_fill_``);
* the logits land in one buffer (B, V), overwritten by the next replay (the caller has used them by
  then: the replays run in stream order).

All rows run to the end (the graph's batch is fixed: ``FastDecoder.keep`` refuses), which costs the GPU
a little work on finished rows and the host nothing. The logits are the eager step's and the HF
forward's within 1e-5 (the attention reduces over the padded length, masked, instead of the written
slots: a different summation order), and a replay gives the bits of the same step run eagerly (both
tested on an H200, tests/test_graphdecode.py). The last graph and its memory pool (one step's
temporaries and the (B, V) logits) stay allocated until the next rollout's capture reuses them.

The first step of a rollout runs eagerly on a side stream (it warms up what the kernels lazily
initialise, as ``torch.cuda.graphs`` asks), then the step is captured; each later step is one replay.
A capture that fails turns graphs off for the process with a warning, and the step runs eagerly.
``GPUFLEET_CUDA_GRAPHS=0`` turns them off.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from gpufleet.engine.switches import switched_off

FastDecoder = Any
"""A ``fastdecode.FastDecoder`` (not imported: it imports this module)."""

__all__ = ["GraphStep", "GRAPHS_ENV"]

GRAPHS_ENV = "GPUFLEET_CUDA_GRAPHS"
"""Set to 0 to run the fast decoder's steps eagerly on a GPU (no CUDA graph)."""

_failed: list[str] = []
"""Why a capture failed in this process (then no more are tried)."""

_shared: dict[int, dict] = {}
"""Per CUDA device index: ``pool``, the memory pool of every capture; ``stream``, the side stream of the
warm-ups and captures; ``graph``, the last graph captured (kept alive so that the next capture reuses
its memory); ``owner``, a weak reference to its GraphStep."""


class GraphStep:
    """The decode step of one rollout's ``FastDecoder`` as a replayed CUDA graph (see the module).

    Made by ``FastDecoder.prefill`` where ``wanted``; ``capture=False`` runs the same static-shape step
    eagerly (what the tests check on a CPU)."""

    @staticmethod
    def wanted(decoder: FastDecoder) -> bool:
        """On a CUDA device, unless ``GPUFLEET_CUDA_GRAPHS=0`` or a capture failed in this process."""
        return decoder.embed.device.type == "cuda" and not switched_off(GRAPHS_ENV) and not _failed

    def __init__(self, decoder: FastDecoder, capture: bool | None = None):
        batch, _, capacity, _ = decoder.k_cache[0].shape
        device = decoder.embed.device
        self.capture = device.type == "cuda" if capture is None else capture
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = torch.empty((batch, decoder.vocab), dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        # Every slot from the prompt's end on is hidden until its step writes it.
        if decoder.key_mask is None:
            decoder.key_mask = torch.zeros((batch, 1, 1, capacity), dtype=decoder.embed.dtype, device=device)
        decoder.key_mask[..., decoder.length :] = float("-inf")
        for cache in (*decoder.k_cache, *decoder.v_cache):  # a masked slot weighs 0, but 0 * NaN is NaN
            cache[:, :, decoder.length :].zero_()

    def _run(self, decoder: FastDecoder) -> None:
        """The step on the buffers: open the slot in the key mask, compute, leave the logits in place."""
        decoder.key_mask.index_fill_(-1, self.slot, 0.0)
        self.logits.copy_(decoder.layers_step(self.token, self.position, self.slot))

    def __call__(
        self, decoder: FastDecoder, token: torch.Tensor, positions: torch.Tensor, slot: int
    ) -> torch.Tensor:
        """Logits (B, V) of ``token`` (B,) at ``positions`` (B,) written to cache slot ``slot``."""
        self.token.copy_(token)
        self.position.copy_(positions)
        self.slot.fill_(slot)
        if self.graph is not None:
            self.graph.replay()
        elif not self.capture:
            self._run(decoder)
        else:
            self._warm_up_and_capture(decoder)
        return self.logits

    def _warm_up_and_capture(self, decoder: FastDecoder) -> None:
        """Run this step eagerly on a side stream (the rollout's real step, and the warm-up a capture
        needs), then capture the same step for the later ones; the capture runs nothing.

        ``capture_begin`` directly rather than ``torch.cuda.graph``, which empties the allocator's cache
        on entry (the training step would then allocate its memory from the driver again, every step).
        The captures of a device share one memory pool, and the last graph is kept until the next one
        is captured, so each capture reuses the pool's memory instead of leaving a new pool behind."""
        device = self.logits.device
        shared = _shared.get(device.index or 0)
        if shared is None:
            shared = {"pool": torch.cuda.graph_pool_handle(), "stream": torch.cuda.Stream(device=device)}
            _shared[device.index or 0] = shared
        stream = shared["stream"]  # one per device: cuBLAS keeps a workspace per stream, made in warm-up
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._run(decoder)
        torch.cuda.current_stream(device).wait_stream(stream)
        previous = shared.get("owner")
        if previous is not None and (owner := previous()) is not None and owner is not self:
            owner.retire()  # its graph's memory is about to be reused
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(shared["pool"], capture_error_mode="thread_local")
                try:
                    self._run(decoder)
                finally:
                    graph.capture_end()
        except RuntimeError as error:  # the step stays eager, for this rollout and the process
            _failed.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
            warnings.warn(
                f"gpufleet: the decode step could not be captured in a CUDA graph ({_failed[0]}); it runs "
                f"eagerly (set {GRAPHS_ENV}=0 to skip trying)",
                RuntimeWarning,
                stacklevel=2,
            )
            self.capture = False
            return
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = graph
        shared["graph"], shared["owner"] = graph, weakref.ref(self)

    def retire(self) -> None:
        """Never replay this graph again (another capture reuses its memory): later steps run eagerly."""
        self.graph, self.capture = None, False
