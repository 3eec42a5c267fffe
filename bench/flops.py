"""Pure arithmetic: the floating-point operations of one GRPO step of a Llama-family decoder, from its
config.json, by phase (`vs_trl.py` divides them by the phase times; `gemm_peak.py` times the same shapes).

A matmul of (m, k) by (k, n) is 2mkn FLOPs. Per token, a forward pass costs 2 x (the decoder layers'
linear weights) plus 2 x hidden x vocab for each position whose logits are taken, plus the attention
scores and their weighted sum, 4 x layers x (heads x head_dim) x the keys it looks at (the full padded
length in training: the SDPA call with a mask computes every pair). A backward pass is two forwards
(the input gradient and the weight gradient of every matmul). Embedding lookups, norms, activations,
softmax and the optimizer are left out: they are not matmuls and are small next to them here.

Phases, named as gpufleet's `timing/*` metrics:
- `generate`: prefill of the prompt (logits of its last position only) and `completion` decode steps of
  every row (finished rows keep decoding until the batch's longest completion ends, as both trainers do);
- `score`: the reference model's forward over prompt + completion (only with beta > 0);
- `backward`: the policy's forward and backward over prompt + completion (logits for the completion only).
"""

from __future__ import annotations

from typing import Any


def layer_params(cfg: dict[str, Any]) -> int:
    """Weights of the matmuls of all decoder layers (q, k, v, o, gate, up, down; biases left out)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return cfg["num_hidden_layers"] * (h * q + 2 * h * kv + q * h + 3 * h * inter)


def head_params(cfg: dict[str, Any]) -> int:
    """Weights of the output projection (hidden x vocab), tied to the embedding or not."""
    return cfg["hidden_size"] * cfg["vocab_size"]


def _attention_width(cfg: dict[str, Any]) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_attention_heads"] * head_dim


def forward_flops(cfg: dict[str, Any], rows: int, length: int, logit_positions: int) -> int:
    """One forward of `rows` sequences of `length` tokens, logits taken at `logit_positions` per row."""
    attention = 4 * cfg["num_hidden_layers"] * _attention_width(cfg) * length * length
    per_row = 2 * layer_params(cfg) * length + 2 * head_params(cfg) * logit_positions + attention
    return rows * per_row


def decode_flops(cfg: dict[str, Any], rows: int, prompt: int, steps: int) -> int:
    """Prefill `prompt` tokens (logits of the last position), then `steps` - 1 one-token steps per row,
    each attending to every token so far."""
    total = forward_flops(cfg, rows, prompt, 1)
    per_token = 2 * (layer_params(cfg) + head_params(cfg))
    attention = 4 * cfg["num_hidden_layers"] * _attention_width(cfg)
    for t in range(1, steps):
        total += rows * (per_token + attention * (prompt + t + 1))
    return total


def step_flops(cfg: dict[str, Any], batch: int, prompt: int, completion: int, beta: float) -> dict[str, int]:
    """FLOPs of one step by phase (see the module docstring), and their `total`.

    `batch` completions of `prompt` (padded) prompt tokens and `completion` (the batch's longest) tokens."""
    length = prompt + completion
    forward = forward_flops(cfg, batch, length, completion + 1)
    phases = {
        "generate": decode_flops(cfg, batch, prompt, completion),
        "score": forward if beta > 0 else 0,
        "backward": 3 * forward,
    }
    return phases | {"total": sum(phases.values())}


def gemm_shapes(
    cfg: dict[str, Any], batch: int, prompt: int, completion: int
) -> list[tuple[str, int, int, int]]:
    """The (name, m, k, n) matmuls the step runs most: training rows (batch x length) and decode rows
    (batch), through q/o, k/v, gate/up, down and the output head; the weight gradients' shapes too."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = _attention_width(cfg)
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    rows = batch * (prompt + completion)
    shapes = []
    for where, m in (("train", rows), ("decode", batch)):
        shapes += [
            (f"{where} q/o", m, h, q),
            (f"{where} k/v", m, h, kv),
            (f"{where} gate/up", m, h, inter),
            (f"{where} down", m, inter, h),
            (f"{where} head", m if where == "decode" else batch * (completion + 1), h, vocab),
        ]
    shapes += [("train dW gate/up", h, rows, inter), ("train dW down", inter, rows, h)]
    return shapes
