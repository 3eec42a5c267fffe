"""``FastDecoder.step`` as one C call (``gpufleet_decode_step`` in engine/cpu_kernels.c) on CPU.

In Python a decode step of a 4-layer model is about 90 torch calls, each a few microseconds of dispatch
and a fresh tensor, around matmuls of 16 rows; SDPA alone took 94 us a call for one query. The C step
runs the same ops on the decoder's packed weights (layout ``"panels"``), its cos / signed-sin tables,
KV cache and key mask, with scratch buffers made once per rollout. Logits agree with the HF forward to
a few 1e-7 (tests/test_fastdecode.py, every supported family) and with the Python step
(tests/test_cpu_kernels.py); a token outside the vocabulary or a position outside the cache raises
IndexError, as the Python step does.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from gpufleet.engine import cpu_kernels

FastDecoder = Any  # engine/fastdecode.FastDecoder, which imports this module

__all__ = ["NativeStep"]

_LAYER_FIELDS = (
    "input_norm",
    "post_norm",
    "qk_norm",
    "qkv",
    "qkv_bias",
    "o",
    "o_bias",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
    "k_cache",
    "v_cache",
)
_INTS = ("rows", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "capacity")
_INTS += ("position", "vocab16", "threads")
_POINTERS = ("token", "token_position", "embed", "cos", "sin", "key_mask", "final_norm", "head", "head_bias")
_POINTERS += ("layer", "x")
_POINTERS += ("normed", "qkv", "attn", "gate_up", "act", "proj", "logits")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in _INTS),
        *((name, ctypes.c_float) for name in ("eps", "qk_eps", "scaling")),
        *((name, ctypes.c_void_p) for name in _POINTERS),
        ("embed_rows", ctypes.c_longlong),
    ]  # gf_step in engine/cpu_kernels.c, field for field


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeStep:
    """The C decode step of one ``FastDecoder`` (built after its weights are read, layout ``"panels"``)."""

    def __init__(self, decoder: FastDecoder):
        first = decoder.layers[0]
        self.hidden = decoder.embed.shape[1]
        self.intermediate = first.gate_up.packed.out_features // 2
        self.lib = cpu_kernels.library()
        self.layers = (_Layer * len(decoder.layers))()
        self.step = _Step(
            layers=len(decoder.layers),
            hidden=self.hidden,
            heads=decoder.heads,
            kv_heads=decoder.kv_heads,
            head_dim=decoder.head_dim,
            intermediate=self.intermediate,
            vocab16=decoder.lm_head.packed.panels.shape[0],
            eps=float(decoder.norm.eps),
            qk_eps=float(first.qk_norm.eps) if first.qk_norm is not None else 0.0,
            scaling=float(decoder.scaling),
            embed=decoder.embed.data_ptr(),
            embed_rows=decoder.embed.shape[0],
            final_norm=decoder.norm.weight.data_ptr(),
            head=decoder.lm_head.packed.panels.data_ptr(),
            head_bias=_ptr(decoder.lm_head.packed.bias),
            layer=ctypes.addressof(self.layers),
        )
        for slot, layer in zip(self.layers, decoder.layers, strict=True):
            for name, linear in (("qkv", layer.qkv), ("o", layer.o_proj), ("gate_up", layer.gate_up)):
                setattr(slot, name, linear.packed.panels.data_ptr())
                setattr(slot, f"{name}_bias", _ptr(linear.packed.bias))
            slot.down, slot.down_bias = layer.down.packed.panels.data_ptr(), _ptr(layer.down.packed.bias)
            slot.input_norm, slot.post_norm = (
                layer.input_norm.weight.data_ptr(),
                layer.post_norm.weight.data_ptr(),
            )
            slot.qk_norm = None if layer.qk_norm is None else layer.qk_norm.weight.data_ptr()
        self.scratch: dict[str, torch.Tensor] = {}
        self.tables: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def supports(decoder: FastDecoder) -> bool:
        """Whether the C step runs this decoder: packed weights, contiguous float32 norm weights."""
        if decoder.layout != "panels" or not cpu_kernels.available():
            return False
        norms = [decoder.norm.weight]
        for layer in decoder.layers:
            norms += [layer.input_norm.weight, layer.post_norm.weight]
            norms += [layer.qk_norm.weight] if layer.qk_norm is not None else []
        return all(w.dtype == torch.float32 and w.is_contiguous() for w in [decoder.embed, *norms])

    def bind(self, decoder: FastDecoder) -> None:
        """Point the step at the decoder's KV caches, RoPE tables and key mask as ``prefill`` left them,
        and make the scratch buffers for its rows. ``keep`` moves kept rows to the front of the same
        tensors, so the pointers stay valid until the next ``prefill``."""
        for slot, k_cache, v_cache in zip(self.layers, decoder.k_cache, decoder.v_cache, strict=True):
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise RuntimeError("the native decode step needs contiguous KV caches")
            slot.k_cache, slot.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self.tables = (decoder.cos_table.contiguous(), decoder.sin_table.contiguous())
        self.step.cos, self.step.sin = (t.data_ptr() for t in self.tables)
        self.step.capacity = decoder.k_cache[0].shape[2]
        self._buffers(decoder.k_cache[0].shape[0], decoder)

    def _buffers(self, rows: int, decoder: FastDecoder) -> None:
        """Scratch for ``rows`` rows (made for the most rows seen; fewer rows use its front)."""
        if self.scratch and self.scratch["normed"].shape[0] >= rows:
            return
        q_dim, kv_dim = decoder.heads * decoder.head_dim, decoder.kv_heads * decoder.head_dim
        widths = {
            "normed": self.hidden,
            "qkv": cpu_kernels.padded(q_dim + 2 * kv_dim),
            "attn": q_dim,
            "gate_up": cpu_kernels.padded(2 * self.intermediate),
            "act": self.intermediate,
            "proj": cpu_kernels.padded(self.hidden),
        }
        self.scratch = {name: torch.empty(rows, width) for name, width in widths.items()}
        self.scratch["x"] = torch.empty(rows, self.hidden)
        for name, buffer in self.scratch.items():
            setattr(self.step, name, buffer.data_ptr())

    def __call__(self, decoder: FastDecoder, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits (B, V) of feeding ``token`` (B,) at ``positions`` (B,); writes the KV cache."""
        rows = token.shape[0]
        if rows > self.scratch["normed"].shape[0] or decoder.k_cache[0].shape[0] != rows:
            raise RuntimeError(f"the native decode step is bound to other rows than these {rows}")
        token, positions = token.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        key_mask = None if decoder.key_mask is None else decoder.key_mask.contiguous()
        logits = torch.empty(rows, self.step.vocab16 * 16)
        s = self.step
        s.rows, s.position, s.threads = rows, decoder.length, torch.get_num_threads()
        s.token, s.token_position, s.key_mask = token.data_ptr(), positions.data_ptr(), _ptr(key_mask)
        s.logits = logits.data_ptr()
        if bad := self.lib.gpufleet_decode_step(ctypes.byref(s)):
            row = (bad - 1) % rows
            if bad <= rows:
                raise IndexError(f"token {int(token[row])} of row {row} is not in the embedding table")
            raise IndexError(
                f"position {int(positions[row])} of row {row} is outside the cache ({s.capacity})"
            )
        return logits[:, : decoder.vocab]
