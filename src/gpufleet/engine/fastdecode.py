"""Prefill and decode steps for Llama / Qwen2 / Qwen3 / Mistral that compute what the HF forward computes.

Rollouts dominate an RL step, and for small batches on CPU most of an HF decode step is per-call overhead
(mask building, cache bookkeeping, module dispatch, Python scalars) rather than arithmetic. ``FastDecoder``
runs the same arithmetic over the model's own weights with less of that overhead:

* the weights are read when the decoder is built, once per ``generate`` call (a policy trained in between
  is read fresh); q/k/v and gate/up are fused into one matmul each (concatenated copies; on CPU every
  weight is copied (in, out), see ``fastdecode_ops.Linear``), and every projection is a direct ``mm``/``addmm`` on
  2-D hidden states (B or N rows, no length axis);
* the KV cache is preallocated, ``(B, kv_heads, prompt + max_new_tokens, head_dim)`` per layer; masks
  are additive and built once from the prompt padding (none at all when no prompt is padded);
* RoPE cos/sin come from a table built once from the model's ``inv_freq`` buffer and
  ``attention_scaling``; q and k are normed (Qwen3) and rotated in one call;
* a decode step attends with ``F.scaled_dot_product_attention`` on the key/value heads directly, the
  query heads of a group folded into the query axis (HF's ``pack_gqa``);
* the prefill skips pad tokens (per-token work runs on the real tokens, packed), and its last layer, the
  final norm and the LM head run on the last position only; a prompt repeated over several rows (a
  GRPO group) is prefilled once and its cache copied to its rows;
* ``keep`` drops finished rows from the cache, so later steps compute the live rows only;
* on a GPU the decode step is captured in a CUDA graph once per rollout and replayed for every later
  token (``graphdecode.GraphStep``; ``GPUFLEET_CUDA_GRAPHS=0`` turns it off): a small model's step is
  hundreds of kernel launches that take longer to issue than to run.

Matched against transformers 5.23 (``models/{llama,qwen2,qwen3,mistral}/modeling_*.py``, which share
these pieces): ``*RMSNorm.forward`` (float32 math, ``weight * (x * rsqrt(mean(x**2) + eps))``),
``*RotaryEmbedding.forward`` (``position_ids.float() * inv_freq``, ``cat(freqs, freqs)``, cos/sin times
``attention_scaling``), ``rotate_half`` / ``apply_rotary_pos_emb``, ``*Attention.forward`` (q/k/v/o
biases when configured; Qwen3's ``q_norm``/``k_norm`` over ``head_dim`` before RoPE; ``scaling``),
``integrations/sdpa_attention.py`` (``repeat_kv``, ``pack_gqa``), ``*MLP.forward``
(``down(silu(gate(x)) * up(x))``), ``*DecoderLayer.forward`` (pre-norm residual blocks),
``*Model.forward`` (``layers[:num_hidden_layers]``, final norm) and ``*ForCausalLM.forward``
(``lm_head`` on the kept positions; tied embeddings share the tensor). Float32 logits agree with the HF
forward to a few 1e-7: the elementwise ops give the same bits, matmuls of other shapes (fused, packed)
may round differently.

``FastDecoder.unsupported_reason(model, max_length)`` (engine/fastdecode_check.py) says why a model must take
the HF path instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpufleet.engine import cpu_kernels, decodecompile, gpuattention
from gpufleet.engine.fastdecode_check import sliding_window, structure_reason, unsupported_reason
from gpufleet.engine.fastdecode_native import NativeStep
from gpufleet.engine.fastdecode_ops import (
    PROJECTIONS,
    Layer,
    Linear,
    Norm,
    attention_inputs,
    distinct_rows,
    mlp_block,
)
from gpufleet.engine.graphdecode import GraphStep

__all__ = ["FastDecoder"]

_COPY_LIMIT_BYTES = 1 << 30
"""The decoder copies weights only up to this much memory (1 GiB): on CPU every projection and the head
in the (in, out) layout (``fastdecode_ops.Linear``) if they fit, else (and on other devices) q/k/v and gate/up fused if
those fit; bigger models run on views of their parameters (for them the copies save nothing measurable)."""


class FastDecoder:
    """Prefill + one-token decode steps of a supported HF causal LM, with a preallocated KV cache.

    Build one per rollout (it reads the weights as they are then)::

        decoder = FastDecoder(model)
        logits = decoder.prefill(ids, mask, positions, max_new_tokens)   # (B, V) float32
        for ...:
            logits = decoder.step(tokens, positions)                     # (B, V) float32

    ``prefill`` takes the left-padded prompts (B, P), their attention mask and position ids (HF's
    ``cumsum(mask) - 1``, clamped at 0); pad positions are never attended by real tokens. Every token
    given to ``step`` (B,) is attended by the later steps of its row: a caller that stops a row (after
    EOS) and discards its logits needs no mask for it, as rows never attend to each other. Positions
    must stay below ``P + max_new_tokens`` (true for the cumsum positions). Call it under
    ``torch.inference_mode()`` or ``torch.no_grad()``.
    """

    unsupported_reason = staticmethod(unsupported_reason)  # why a model must take the HF path (or None)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        layout: str | None = None,
        check: bool = True,
        dtype: torch.dtype | None = None,
    ):
        """Read the weights of ``model``: views of its parameters or copies, by ``layout`` (see
        ``fastdecode_ops.Linear``; default: the fastest that fits in ``_COPY_LIMIT_BYTES``).
        ``check=False`` skips the support check, for a caller that just made it. ``dtype`` (bfloat16 or
        float16 for a float32 model): decode in copies of the weights in that dtype, what the model
        computes in bf16 once cast (``train.precision: bf16`` over float32 weights: half the bytes a
        step reads); the same logits as the model cast to ``dtype``."""
        if check and (reason := structure_reason(model)) is not None:
            raise ValueError(f"FastDecoder does not support this model: {reason}")
        config, inner = model.config, model.model
        layers = inner.layers[: config.num_hidden_layers]
        attn0 = layers[0].self_attn
        self.window = sliding_window(model)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.attention_scaling = rotary.attention_scaling
        if dtype == inner.embed_tokens.weight.dtype:
            dtype = None  # nothing to cast
        self.embed = inner.embed_tokens.weight if dtype is None else inner.embed_tokens.weight.to(dtype)
        self.norm = Norm.of(inner.norm, dtype)
        self.layout = layout or self._layout_that_fits(model, layers, dtype)
        self.lm_head = Linear(model.lm_head, layout=self.layout, dtype=dtype)
        if dtype is not None and model.lm_head.weight is inner.embed_tokens.weight:  # tied: one copy
            self.lm_head.parts = [(self.embed.t(), self.lm_head.parts[0][1])]
        self.vocab = model.lm_head.weight.shape[0]
        self.layers = [Layer.of(layer, self.layout, dtype) for layer in layers]
        self.native = NativeStep(self) if NativeStep.supports(self) else None  # step() in one C call
        self.graph: GraphStep | None = None  # set by prefill on a GPU: step() as one CUDA graph replay
        # Set by prefill: per layer (B, kv_heads, capacity, head_dim) caches, the additive key mask of
        # the decode steps (None: no padding), cos / signed-sin tables by position, tokens cached.
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.key_mask: torch.Tensor | None = None
        self.start: torch.Tensor | None = None  # (B,) each row's first real slot, where gpuattention runs
        self.cos_table = self.sin_table = torch.empty(0)
        self.length = 0

    @staticmethod
    def _layout_that_fits(model: torch.nn.Module, layers, dtype: torch.dtype | None = None) -> str:
        """On CPU, if copies of every projection and the head fit in ``_COPY_LIMIT_BYTES``: ``"panels"``
        for float32 weights where ``cpu_kernels`` builds, else ``"dense"``. Otherwise ``"fused"`` if the
        fused q/k/v and gate/up copies fit, else ``"views"``."""

        def size(names: tuple[str, ...]) -> int:
            modules = [layer.get_submodule(name) for layer in layers for name in names]
            return sum(m.weight.numel() * m.weight.element_size() for m in modules)

        head = model.lm_head.weight
        if (
            head.device.type == "cpu"
            and size(PROJECTIONS) + head.numel() * head.element_size() <= _COPY_LIMIT_BYTES
        ):
            return "panels" if (dtype or head.dtype) == torch.float32 and cpu_kernels.available() else "dense"
        fused = tuple(name for name in PROJECTIONS if not name.endswith(("o_proj", "down_proj")))
        return "fused" if size(fused) <= _COPY_LIMIT_BYTES else "views"

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see ``fastdecode_ops.rope``) of ``positions`` (...,) -> (..., head_dim), computed as
        ``*RotaryEmbedding.forward`` does."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        dtype = self.embed.dtype  # HF casts them to the hidden states' dtype
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 logits of the last position's hidden states (B, hidden), contiguous (on a
        GPU the head's few-row product comes transposed)."""
        return self.lm_head(self.norm(x)).float().contiguous()

    def _attend_last(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int | None
    ) -> torch.Tensor:
        """Attention of one query per row, q (B, H, D), to the first ``length`` cached keys -> (B, H*D)
        (None: to the whole cache, the key mask hiding the slots not written yet).

        The query heads of a group share a key/value head: they are folded into the query axis (HF's
        ``pack_gqa``), (B, H, D) -> (B, H_kv, groups, D), query head h using key/value head h // groups.
        """
        batch = q.shape[0]
        keys = slice(None) if length is None else slice(None, length)
        out = F.scaled_dot_product_attention(
            q.reshape(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim),
            k_cache[:, :, keys],
            v_cache[:, :, keys],
            attn_mask=None if self.key_mask is None else self.key_mask[..., keys],
            scale=self.scaling,
        )
        return out.reshape(batch, -1)

    def _layout(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor, capacity: int
    ) -> tuple:
        """The packed (N, ...) <-> padded (B, P, ...) conversions, the prefill mask (None: plain causal),
        the real tokens and their positions; sets the decode steps' key mask."""
        batch, width = input_ids.shape
        device, dtype = self.embed.device, self.embed.dtype
        padded = not bool(valid.all())
        if padded:
            rows, cols = valid.nonzero(as_tuple=True)  # the real tokens, row by row

            def to_padded(t: torch.Tensor) -> torch.Tensor:  # (N, ...) -> (B, P, ...), zeros at pads
                out = t.new_zeros((batch, width, *t.shape[1:]))
                out[rows, cols] = t
                return out

            def to_packed(t: torch.Tensor) -> torch.Tensor:  # (B, P, ...) -> (N, ...)
                return t[rows, cols]

            # Additive masks (SDPA turns a boolean mask into one on every call). Decode steps: every
            # row attends to its real prompt tokens and to all generated ones.
            self.key_mask = torch.zeros((batch, 1, 1, capacity), dtype=dtype, device=device)
            self.key_mask[:, 0, 0, :width].masked_fill_(~valid, float("-inf"))
            # Prefill: causal and not a pad key. A pad query also sees itself, so that no row of the
            # softmax is empty (its output is never used: real tokens do not attend to pad keys).
            causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
            diagonal = torch.eye(width, dtype=torch.bool, device=device)
            allowed = (causal & valid[:, None, None, :]) | diagonal
            prefill_mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            prefill_mask.masked_fill_(~allowed, float("-inf"))
            tokens, positions = to_packed(input_ids), to_packed(position_ids)
        else:  # packed and padded layouts coincide: plain causal attention (SDPA's is_causal)

            def to_padded(t: torch.Tensor) -> torch.Tensor:
                return t.view(batch, width, *t.shape[1:])

            def to_packed(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(batch * width, *t.shape[2:])

            self.key_mask = prefill_mask = None
            tokens, positions = input_ids.reshape(-1), position_ids.reshape(-1)
        return to_padded, to_packed, prefill_mask, tokens, positions

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """Run the left-padded prompts (B, P), allocate the cache for ``max_new_tokens`` more tokens and
        return the logits (B, V) of the last position.

        A prompt given in several rows (the G completions of a group) is run once: its cache rows and
        logits are copied to each of its rows, which go on separately from there.
        """
        first, inverse = distinct_rows(input_ids, attention_mask)
        if len(first) == len(input_ids):
            logits = self._prefill(input_ids, attention_mask, position_ids, max_new_tokens)
        else:
            logits = self._prefill(
                input_ids[first], attention_mask[first], position_ids[first], max_new_tokens
            ).index_select(0, inverse)
            # a layer at a time: at most one extra (u-row) layer; index_select, not cache[inverse]: on
            # the CPU 5x faster for these whole-row copies (88 -> 16 us for one small-model layer)
            for caches in (self.k_cache, self.v_cache):
                for i, cache in enumerate(caches):
                    caches[i] = cache.index_select(0, inverse)
            if self.key_mask is not None:
                self.key_mask = self.key_mask.index_select(0, inverse)
        if self.native is not None:
            self.native.bind(self)
        self.start = None
        if gpuattention.usable(input_ids.device):  # the left padding of each row: its keys begin there
            self.start = (attention_mask == 0).sum(dim=1)
        self.graph = GraphStep(self) if GraphStep.wanted(self) else None
        return logits

    def _prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """``prefill`` of the rows as given (``prefill`` passes each distinct prompt once).

        Pad tokens are skipped: the per-token work (norms, projections, RoPE, MLP) runs on the real
        tokens only, packed into (N, hidden); they are scattered to the padded (B, P) layout for the
        attention and the cache. The last layer needs its outputs at the last position only (its keys
        and values come from its input), so there it runs like a decode step, one query per row.
        """
        batch, width = input_ids.shape
        device, dtype = self.embed.device, self.embed.dtype
        capacity = width + max_new_tokens
        if self.window is not None and capacity > self.window:
            raise ValueError(f"{capacity} tokens do not fit in the sliding window ({self.window})")
        valid = attention_mask.bool()
        lengths = valid.sum(dim=1)
        if not bool(valid[:, -1].all()):
            raise ValueError("prompts must be left-padded, every row with at least one token")
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.cos_table, self.sin_table = self._cos_sin(torch.arange(capacity, device=device))
        to_padded, to_packed, prefill_mask, tokens, positions = self._layout(
            input_ids, position_ids, valid, capacity
        )
        last = lengths.cumsum(dim=0) - 1  # packed index of each row's last token
        groups = self.heads // self.kv_heads
        x = F.embedding(tokens, self.embed)  # (N, hidden)
        cos, signed_sin = self._cos_sin(positions)
        cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # (N, 1, D): shared by the heads
        for i, (layer, k_cache, v_cache) in enumerate(
            zip(self.layers, self.k_cache, self.v_cache, strict=True)
        ):
            q, k, v = attention_inputs(layer, x, cos, signed_sin, self.heads, self.kv_heads, self.head_dim)
            k_cache[:, :, :width] = to_padded(k).transpose(1, 2)
            v_cache[:, :, :width] = to_padded(v).transpose(1, 2)
            if i == len(self.layers) - 1:
                x = x[last]
                x = x + layer.o_proj(self._attend_last(q[last], k_cache, v_cache, width))
            else:
                keys, values = k_cache[:, :, :width], v_cache[:, :, :width]
                if groups > 1:  # HF's repeat_kv
                    keys = keys.repeat_interleave(groups, dim=1)
                    values = values.repeat_interleave(groups, dim=1)
                out = F.scaled_dot_product_attention(
                    to_padded(q).transpose(1, 2),
                    keys,
                    values,
                    attn_mask=prefill_mask,
                    is_causal=prefill_mask is None,
                    scale=self.scaling,
                )
                x = x + layer.o_proj(to_packed(out.transpose(1, 2)).flatten(1))
            x = mlp_block(layer, x)
        self.length = width
        return self._logits(x)

    def keep(self, rows: torch.Tensor) -> None:
        """Go on with the cached rows ``rows`` (indices, in this order) only: later steps take and give
        those rows. A row's logits do not depend on the other rows (bitwise, tested), so dropping
        finished rows changes nothing but the work. The kept rows move to the front of the same cache
        tensors (one layer's kept rows are copied at a time): the cache never takes more memory. Not
        with a CUDA graph (``self.graph``), whose shapes are fixed: it runs every row to the end."""
        if self.graph is not None:
            raise RuntimeError("a CUDA-graphed decoder runs all its rows: keep() cannot drop any")
        n = len(rows)
        for caches in (self.k_cache, self.v_cache):
            for i, cache in enumerate(caches):
                cache[:n] = cache.index_select(0, rows)
                caches[i] = cache[:n]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)
        if self.start is not None:
            self.start = self.start.index_select(0, rows)

    def step(self, token: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,) at ``position_ids`` (B,) or (B, 1); return next-token logits (B, V).

        Hidden states stay (B, hidden): one row per sequence, no length axis.
        """
        batch, t = token.shape[0], self.length
        if t >= self.k_cache[0].shape[2]:
            raise RuntimeError("the KV cache is full: prefill with a larger max_new_tokens")
        positions = position_ids.reshape(batch)
        if self.graph is not None:
            logits = self.graph(self, token, positions, t)
        elif self.native is not None:
            logits = self.native(self, token, positions)
        else:
            logits = self.layers_step(token, positions, t)
        self.length = t + 1
        return logits

    def layers_step(
        self, token: torch.Tensor, positions: torch.Tensor, slot: int | torch.Tensor
    ) -> torch.Tensor:
        """The decode step's arithmetic: tokens (B,) at ``positions`` (B,) into cache slot ``slot`` -> logits.

        ``slot`` an int: attend to the slots before it and to it (the key mask, if any, cut there). A
        one-element tensor (``GraphStep``, where no value may come from the host): write there through
        an index op and attend to the whole cache, the key mask (which the caller opened at ``slot``)
        hiding the slots not written yet. With ``gpuattention`` (``self.start`` set) its kernel writes the
        slot and attends to each row's written keys only.
        """
        cos, signed_sin = self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)
        x = F.embedding(token, self.embed)
        length = slot + 1 if isinstance(slot, int) else None
        if self.start is not None and length is not None:  # gpuattention reads the slot from the device
            slot = torch.tensor([slot], device=x.device)
        pre, tail = decodecompile.pieces(x.device)
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            q, k, v = pre(layer, x, cos, signed_sin, self.heads, self.kv_heads, self.head_dim)
            if self.start is not None:  # the kernel writes k and v to the slot too
                attended = gpuattention.attend(
                    q, k_cache, v_cache, self.start, slot, self.scaling, new=(k, v)
                )
            else:
                _write_slot(k_cache, v_cache, slot, k, v)
                attended = self._attend_last(q, k_cache, v_cache, length)
            x = tail(layer, x, attended)
        return self._logits(x)


def _write_slot(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write a step's keys and values (B, H_kv, D) to cache slot ``slot`` (an int, or a one-element tensor
    read on the device: an index copy, which a CUDA graph can replay)."""
    if isinstance(slot, torch.Tensor):
        k_cache.index_copy_(2, slot, k.unsqueeze(2))
        v_cache.index_copy_(2, slot, v.unsqueeze(2))
    else:
        k_cache[:, :, slot] = k
        v_cache[:, :, slot] = v
