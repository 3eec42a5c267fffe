"""config.json of a few well-known hub models, so `plan`/`check` can size them offline.

`gpufleet check` and `plan` never download. A hub id whose config.json is neither a local folder nor in
the local Hugging Face cache is looked up here. Each entry keeps the architecture fields of the model's
published config.json (the fields the memory model reads); the parameter count each one yields is
pinned in tests/test_plan_memory.py against the model built by transformers (meta device) and against
the published total:

    Qwen2.5-0.5B 494.0M, 1.5B 1.54B, 3B 3.09B, 7B 7.62B; Qwen3-0.6B 0.60B, 1.7B 1.72B;
    Llama-3.2-1B 1.24B, Llama-3.1-8B 8.03B; Mistral-7B 7.24B (v0.3: 7.25B); gemma-2-2b 2.61B.

No torch import.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def _qwen2(hidden, inter, layers, heads, kv, vocab, tie, max_pos=32768) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    }


def _qwen3(hidden, inter, layers, heads, kv, tie, max_pos=40960) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "attention_bias": False,
        "vocab_size": 151936,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "torch_dtype": "bfloat16",
    }


def _llama3(hidden, inter, layers, heads, kv, tie, head_dim) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0 if hidden < 4096 else 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "torch_dtype": "bfloat16",
    }


def _mistral7b(vocab, sliding_window) -> dict[str, Any]:
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0 if sliding_window else 1000000.0,
        "sliding_window": sliding_window,
        "torch_dtype": "bfloat16",
    }


_GEMMA2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "float32",
}

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": _qwen2(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-0.5B-Instruct": _qwen2(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B": _qwen2(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B-Instruct": _qwen2(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-3B-Instruct": _qwen2(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen/Qwen2.5-7B": _qwen2(3584, 18944, 28, 28, 4, 152064, False, 131072),
    "Qwen/Qwen2.5-7B-Instruct": _qwen2(3584, 18944, 28, 28, 4, 152064, False),
    "Qwen/Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, 8, True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, 8, True),
    "meta-llama/Llama-3.2-1B-Instruct": _llama3(2048, 8192, 16, 32, 8, True, 64),
    "meta-llama/Llama-3.1-8B": _llama3(4096, 14336, 32, 32, 8, False, 128),
    "meta-llama/Llama-3.1-8B-Instruct": _llama3(4096, 14336, 32, 32, 8, False, 128),
    "mistralai/Mistral-7B-v0.1": _mistral7b(32000, 4096),
    "mistralai/Mistral-7B-Instruct-v0.2": _mistral7b(32000, None),
    "mistralai/Mistral-7B-Instruct-v0.3": _mistral7b(32768, None),
    "google/gemma-2-2b": _GEMMA2_2B,
    "google/gemma-2-2b-it": _GEMMA2_2B,
}
"""Hub id -> the architecture fields of its published config.json."""

_BY_LOWER = {k.lower(): k for k in KNOWN_CONFIGS}


def known_config(hub_id: str) -> dict[str, Any] | None:
    """A copy of the config.json of a known hub model (case-insensitive id), or None."""
    key = _BY_LOWER.get(hub_id.strip().lower())
    return copy.deepcopy(KNOWN_CONFIGS[key]) if key else None


def lookup_config(path: str, env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str] | None:
    """(config.json dict, where it came from) for a model path, or None when it is not available offline.

    Order: `builtin:<name>`, a local folder, a hub id in the local Hugging Face cache (all through
    `gpufleet.models.info`), then this module's table of known hub models. Never downloads.
    """
    from gpufleet.models.info import looks_like_hub_id, read_model_info

    info = read_model_info(path, env)
    if info is not None:
        return info.raw, info.source
    if looks_like_hub_id(path):
        raw = known_config(path)
        if raw is not None:
            return raw, "gpufleet's table of known models (src/gpufleet/models/known.py)"
    return None
