"""When ``FastDecoder`` (engine/fastdecode.py) computes exactly what the Hugging Face forward computes.

``FastDecoder.unsupported_reason(model, max_length)`` says why a model must take the HF path instead. It
is conservative: anything but exactly the plain HF classes (subclasses, FSDP/DDP or PEFT wrappers,
patched ``forward``, forward hooks, hub kernels), parameters that are not local tensors of one dtype
(float32, bfloat16 or float16),
autocast, training mode, a bidirectional config, a RoPE type whose frequencies change with the sequence
length (any type not in ``_STATIC_ROPE_TYPES``, e.g. ``dynamic``, ``longrope``), partial rotary
embeddings, a sliding window narrower than the sequence, an activation other than SiLU, or an attention
implementation other than ``sdpa``/``eager`` (the same attention).
"""

from __future__ import annotations

import importlib

import torch

_FAMILY = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
}
"""model_type -> (HF modeling module, class-name prefix) of the supported architectures."""

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE types whose ``inv_freq`` and ``attention_scaling`` are fixed at init (``modeling_rope_utils``:
``dynamic_rope_update`` only touches ``dynamic`` and ``longrope``), so the live buffer is exact."""

_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

# --- the checks ----------------------------------------------------------------


def _classes(model_type: str) -> dict[str, type]:
    """The HF classes of ``model_type``: causal_lm, model, layer, attention, mlp, norm, rotary."""
    module_name, prefix = _FAMILY[model_type]
    module = importlib.import_module(module_name)
    names = {
        "causal_lm": "ForCausalLM",
        "model": "Model",
        "layer": "DecoderLayer",
        "attention": "Attention",
        "mlp": "MLP",
        "norm": "RMSNorm",
        "rotary": "RotaryEmbedding",
    }
    return {key: getattr(module, prefix + suffix) for key, suffix in names.items()}


def structure_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` is not exactly a plain, float32, eval-mode supported HF model (None if it is)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILY:
        return f"{type(model).__name__} (model_type {model_type!r}) is not Llama/Qwen2/Qwen3/Mistral"
    cls = _classes(model_type)
    for check in (_kind_reason, _modules_reason, _parameters_reason, _shapes_reason):
        reason = check(model, cls)
        if reason is not None:
            return reason
    return None


def _kind_reason(model: torch.nn.Module, cls: dict[str, type]) -> str | None:
    """The class, mode and config switches the fast path cannot follow."""
    config = model.config
    if type(model) is not cls["causal_lm"]:
        return f"{type(model).__name__} is not exactly {cls['causal_lm'].__name__} (wrapped or subclassed)"
    if model.training:
        return "the model is in training mode"
    if getattr(model, "_use_kernels", False):
        return "hub kernels are enabled"
    if not getattr(config, "is_causal", True):
        return "the config is not causal"
    if config._attn_implementation not in _ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {config._attn_implementation!r}"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    return None


def _modules_reason(model: torch.nn.Module, cls: dict[str, type]) -> str | None:
    """Every module the forward runs is exactly its HF class, without hooks or a patched forward."""
    config, model_type = model.config, model.config.model_type
    from torch.nn.modules import module as nn_module
    from transformers.activations import SiLUActivation

    inner = model.model
    n_layers = config.num_hidden_layers
    if type(inner) is not cls["model"] or len(inner.layers) < n_layers:
        return "unexpected model structure"
    layers = list(inner.layers[:n_layers])
    # Every module the forward runs must be exactly the HF class: this rules out FSDP (fully_shard swaps
    # the class), LoRA / quantized / parametrized linears and other replacements.
    expected = [
        (model, cls["causal_lm"]),
        (inner, cls["model"]),
        (inner.embed_tokens, torch.nn.Embedding),
        (inner.norm, cls["norm"]),
        (inner.rotary_emb, cls["rotary"]),
        (model.lm_head, torch.nn.Linear),
    ]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        expected += [
            (layer, cls["layer"]),
            (layer.input_layernorm, cls["norm"]),
            (layer.post_attention_layernorm, cls["norm"]),
            (attn, cls["attention"]),
            (mlp, cls["mlp"]),
            (mlp.act_fn, SiLUActivation),
        ]
        expected += [(getattr(attn, n), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        expected += [(getattr(mlp, n), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")]
        if model_type == "qwen3":
            expected += [(attn.q_norm, cls["norm"]), (attn.k_norm, cls["norm"])]
    for module, want in expected:
        if type(module) is not want:
            return f"{type(module).__name__} where {want.__name__} was expected (wrapped or replaced)"
        if _changed_forward(module):
            return f"{type(module).__name__} has forward hooks or a patched forward"
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global forward hooks are registered"
    if inner.embed_tokens.max_norm is not None:
        return "the embedding has max_norm"

    return None


def _parameters_reason(model: torch.nn.Module, cls: dict[str, type]) -> str | None:
    """Plain local parameters of one floating dtype (float32, bfloat16 or float16) on one device, no
    autocast."""
    params = list(model.parameters())
    device, dtype = params[0].device, params[0].dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{dtype} parameters (the fast path takes float32, bfloat16 or float16)"
    for p in params:
        if type(p.data) is not torch.Tensor or p.is_meta:
            return "parameters are not plain local tensors (sharded or on the meta device)"
        if p.dtype != dtype:
            return f"parameters of several dtypes ({dtype} and {p.dtype})"
        if p.device != device:
            return "parameters span several devices"
    if torch.is_autocast_enabled(device.type):
        return "autocast is enabled"

    return None


def _shapes_reason(model: torch.nn.Module, cls: dict[str, type]) -> str | None:
    """A static RoPE over the whole head, and the same attention / MLP shapes in every layer."""
    config, model_type = model.config, model.config.model_type
    inner = model.model
    layers = list(inner.layers[: config.num_hidden_layers])
    rotary = inner.rotary_emb
    if rotary.rope_type not in _STATIC_ROPE_TYPES:
        return f"RoPE type {rotary.rope_type!r}"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        return "the query heads are not a multiple of the key/value heads"
    dim = layers[0].self_attn.head_dim
    if dim % 2 or rotary.inv_freq.shape != (dim // 2,) or not rotary.inv_freq.is_floating_point():
        return "partial rotary embedding"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            attn.head_dim != dim
            or attn.scaling != layers[0].self_attn.scaling
            or attn.num_key_value_groups != heads // kv_heads
            or attn.q_proj.out_features != heads * dim
            or attn.k_proj.out_features != kv_heads * dim
            or attn.v_proj.out_features != kv_heads * dim
            or attn.o_proj.in_features != heads * dim
        ):
            return "unexpected attention shapes"
        if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) > 1:
            return "q/k/v projections with and without bias"
        if (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
            return "gate/up projections with and without bias"
        if model_type == "qwen3" and attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            return "q_norm and k_norm have different eps"
    return None


_REQUIRE_GRADS_HOOK = "enable_input_require_grads.<locals>.make_inputs_require_grads"
"""The forward hook transformers puts on the input embedding with gradient checkpointing
(``activation_checkpointing_enable``): it marks the embedding's output as requiring grad, which changes
no value, and the fast decoder reads the embedding's weight without calling the module."""


def _changed_forward(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward may not be its class's: a pre-hook, a patched forward, or a forward
    hook other than ``_REQUIRE_GRADS_HOOK``."""
    hooks = [
        h
        for h in module._forward_hooks.values()
        if not getattr(h, "__qualname__", "").endswith(_REQUIRE_GRADS_HOOK)
    ]
    return bool(hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def sliding_window(model: torch.nn.Module) -> int | None:
    """The narrowest sliding window of the layers the forward runs, or None (full attention everywhere).

    Qwen2/Qwen3 set ``self_attn.sliding_window`` on their ``sliding_attention`` layers; Mistral applies
    ``config.sliding_window`` to every layer. HF's mask keeps key ``j`` for query ``i`` when
    ``i - j < window`` (``masking_utils.sliding_window_overlay``), so a sequence of at most ``window``
    tokens is attended exactly as under full causal attention.
    """
    config = model.config
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    windows = [
        layer.self_attn.sliding_window
        for layer in model.model.layers[: config.num_hidden_layers]
        if getattr(layer.self_attn, "sliding_window", None) is not None
    ]
    return min(windows) if windows else None


def unsupported_reason(model: torch.nn.Module, max_length: int | None = None) -> str | None:
    """Why ``model`` cannot take the fast path for sequences up to ``max_length`` tokens, or None.

    ``max_length`` (prompt width + new tokens) matters only for a sliding-window config: the window
    restricts nothing (the fast path is exact) when the whole sequence fits in it; unknown (None), it
    counts as too long.
    """
    reason = structure_reason(model)
    if reason is not None:
        return reason
    window = sliding_window(model)
    if window is not None and (max_length is None or max_length > window):
        return f"sliding window {window} is narrower than the sequence ({max_length} tokens)"
    return None
