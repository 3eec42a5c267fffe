"""What a model looks like to the planner: its config.json read into `Arch`, its parameters counted.

    arch = arch_from_config(raw); params = count_parameters(arch); models = load_models(r, env)

No torch import: config.json (found through `gpufleet.models.info`, or `models/known.py`) is all it reads.

Parameters (`count_parameters`)
    Exact for the decoder families below, from config.json alone: token embeddings (+ learned
    positions for GPT-2), per layer q/k/v/o projections (GQA: k and v have `num_key_value_heads x
    head_dim` outputs; Qwen2 has q/k/v biases, Llama `attention_bias` puts biases on q/k/v/o, GPT-2 has
    biases everywhere), Qwen3's per-head q/k RMSNorms, the MLP (SwiGLU: gate, up, down of
    `intermediate_size`; GPT-2: fc, proj of `n_inner` or 4h), the norms (RMSNorm: a weight; LayerNorm:
    weight and bias; Gemma2 has four per layer), the final norm, and the LM head unless
    `tie_word_embeddings`. A reward model (sequence classification) has a `num_labels x hidden` score
    head instead of the LM head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.config.load import Resolved
from gpufleet.errors import UserError
from gpufleet.models.info import (
    checkpoint_dtype,
    has_weights,
    looks_like_hub_id,
    reward_head_problem,
    text_config,
)
from gpufleet.paths import user_path

SUPPORTED_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gpt2": "gpt2",
}
"""config.json `model_type` -> the family whose formulas apply."""

# transformers' config-class defaults, for keys a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"tie_word_embeddings": False, "num_key_value_heads": 8},
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"tie_word_embeddings": False, "attention_bias": False, "head_dim": 128},
    "gemma": {"tie_word_embeddings": True, "attention_bias": False, "head_dim": 256},
    "gemma2": {
        "tie_word_embeddings": True,
        "attention_bias": False,
        "head_dim": 256,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gpt2": {
        "tie_word_embeddings": True,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "activation_function": "gelu_new",
    },
}


class UnsupportedModel(ValueError):
    """The memory model has no formulas for this config.json (the message says which field)."""


@dataclass(frozen=True)
class Arch:
    """The architecture numbers the formulas use, read from config.json."""

    model_type: str
    family: str
    """`llama` (Llama, Mistral, Qwen2, Qwen3), `gemma`, `gemma2` or `gpt2`."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_positions: int | None = None
    checkpoint_dtype: str | None = None
    """`torch_dtype`/`dtype` of the checkpoint (what a reward model loads in)."""
    final_logit_softcap: bool = False
    eager_attention: bool = False
    """Attention with explicit probabilities (Gemma2 soft-capping, GPT-2 attention dropout)."""
    resid_dropout: bool = False
    embd_dropout: bool = False
    gelu_new: bool = False
    num_labels: int = 1

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _int(cfg: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise UnsupportedModel(f"config.json has no positive integer {' / '.join(names)}")


def arch_from_config(raw: Mapping[str, Any]) -> Arch:
    """The `Arch` of a config.json dict; UnsupportedModel names the field or model_type it cannot read.

    Where the text model's numbers live (`text_config` of vision-language configs) and the checkpoint
    dtype are read by `gpufleet.models.info`, as for the checks; the family's numbers are read here.
    """
    cfg = text_config(raw)
    model_type = str(cfg.get("model_type") or raw.get("model_type") or "")
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type or '(missing)'!r} has no memory formulas "
            f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
        )
    family = SUPPORTED_TYPES[model_type]
    d = {**_DEFAULTS.get(model_type, {}), **{k: v for k, v in cfg.items() if v is not None}}
    labels = d.get("id2label")
    common = {
        "model_type": model_type,
        "family": family,
        "vocab_size": _int(d, "vocab_size"),
        "checkpoint_dtype": checkpoint_dtype(raw),
        "num_labels": _int(
            d, "num_labels", default=len(labels) if isinstance(labels, Mapping) and labels else 1
        ),
    }
    return _gpt2_arch(d, common) if family == "gpt2" else _decoder_arch(d, common)


def _gpt2_arch(d: Mapping[str, Any], common: dict[str, Any]) -> Arch:
    h = _int(d, "n_embd", "hidden_size")
    heads = _int(d, "n_head", "num_attention_heads")
    return Arch(
        **common,
        hidden_size=h,
        num_layers=_int(d, "n_layer", "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=h // heads,
        intermediate_size=_int(d, "n_inner", default=4 * h),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        max_positions=_int(d, "n_positions", "max_position_embeddings"),
        eager_attention=float(d.get("attn_pdrop") or 0) > 0,
        resid_dropout=float(d.get("resid_pdrop") or 0) > 0,
        embd_dropout=float(d.get("embd_pdrop") or 0) > 0,
        gelu_new=str(d.get("activation_function")) == "gelu_new",
    )


def _decoder_arch(d: Mapping[str, Any], common: dict[str, Any]) -> Arch:
    """Llama, Mistral, Qwen2/3, Gemma, Gemma2."""
    model_type, family = common["model_type"], common["family"]
    h = _int(d, "hidden_size")
    heads = _int(d, "num_attention_heads")
    attention_bias = bool(d.get("attention_bias", False))
    positions = d.get("max_position_embeddings")
    return Arch(
        **common,
        hidden_size=h,
        num_layers=_int(d, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int(d, "num_key_value_heads", default=heads),
        head_dim=_int(d, "head_dim", default=h // heads),
        intermediate_size=_int(d, "intermediate_size"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(d.get("mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3",
        max_positions=positions if isinstance(positions, int) else None,
        final_logit_softcap=family == "gemma2" and bool(d.get("final_logit_softcapping")),
        eager_attention=family == "gemma2" and bool(d.get("attn_logit_softcapping")),
    )


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model, by part (tied LM heads counted once, in `embedding`)."""

    embedding: int
    """Token embeddings (+ learned position embeddings)."""
    per_layer: int
    num_layers: int
    final_norm: int
    head: int
    """LM head (0 when tied to the embeddings) or a classifier's score head."""
    matmul: int
    """Weights of every matrix multiply, the LM head included (tied or not): what autocast copies."""
    head_matmul: int
    """Weights of the LM head's (or score head's) matmul, tied or not."""
    largest_matmul: int
    """The largest single matmul weight (autocast casts one at a time in no-grad inference)."""
    tensors: int
    """Number of parameter tensors."""

    @property
    def layers(self) -> int:
        return self.per_layer * self.num_layers

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers (FSDP's root unit: embeddings, final norm, head)."""
        return self.embedding + self.final_norm + self.head

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.head


def count_parameters(arch: Arch, head: str = "causal_lm") -> ParamCount:
    """Exact parameter count of `AutoModelForCausalLM` (head="causal_lm") or of
    `AutoModelForSequenceClassification` (head="classifier") built from the config."""
    h, v = arch.hidden_size, arch.vocab_size
    body = _gpt2_body(arch) if arch.family == "gpt2" else _decoder_body(arch)
    if head == "classifier":
        head_params, head_matmul, head_tensors = arch.num_labels * h, arch.num_labels * h, 1
    elif head == "causal_lm":
        tied = arch.tie_word_embeddings
        head_params, head_matmul, head_tensors = (0 if tied else v * h), v * h, (0 if tied else 1)
    else:
        raise ValueError(f"head must be 'causal_lm' or 'classifier', got {head!r}")
    return ParamCount(
        embedding=body["embedding"],
        per_layer=body["per_layer"],
        num_layers=arch.num_layers,
        final_norm=body["final_norm"],
        head=head_params,
        matmul=body["layer_matmul"] * arch.num_layers + head_matmul,
        head_matmul=head_matmul,
        largest_matmul=max(body["largest"], head_matmul),
        tensors=body["tensors"] + head_tensors,
    )


def _gpt2_body(arch: Arch) -> dict[str, int]:
    """GPT-2 without its head: fused c_attn, c_proj, c_fc, mlp c_proj (all biased), two LayerNorms."""
    h, inter = arch.hidden_size, arch.intermediate_size
    attn = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * inter + inter) + (inter * h + h)
    return {
        "per_layer": attn + mlp + 2 * (2 * h),
        "embedding": arch.vocab_size * h + (arch.max_positions or 0) * h,
        "final_norm": 2 * h,
        "layer_matmul": 3 * h * h + h * h + 2 * h * inter,
        "largest": max(3 * h * h, h * inter),
        "tensors": 2 + 12 * arch.num_layers + 2,  # wte, wpe; 12 per layer; ln_f weight, bias
    }


def _decoder_body(arch: Arch) -> dict[str, int]:
    """Llama-family decoders without the head: q/k/v/o (+ biases, q/k norms), SwiGLU MLP, RMSNorms."""
    h, inter, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_dim, arch.kv_dim
    attn = h * q + 2 * h * kv + q * h
    if arch.qkv_bias:
        attn += q + 2 * kv
    if arch.o_bias:
        attn += h
    if arch.qk_norm:
        attn += 2 * arch.head_dim
    mlp = 3 * h * inter + ((2 * inter + h) if arch.mlp_bias else 0)
    norms_per_layer = 4 if arch.family == "gemma2" else 2
    tensors_per_layer = (
        7
        + norms_per_layer
        + (3 if arch.qkv_bias else 0)
        + (1 if arch.o_bias else 0)
        + (2 if arch.qk_norm else 0)
        + (3 if arch.mlp_bias else 0)
    )
    return {
        "per_layer": attn + mlp + norms_per_layer * h,
        "embedding": arch.vocab_size * h,
        "final_norm": h,
        "layer_matmul": h * q + 2 * h * kv + q * h + 3 * h * inter,
        "largest": max(h * q, h * inter),
        "tensors": 1 + tensors_per_layer * arch.num_layers + 1,  # embeddings; layers; final norm
    }


# ------------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelSpec:
    """A model the plan sizes: its path, where its config.json came from, its numbers."""

    path: str
    source: str
    arch: Arch
    params: ParamCount


@dataclass(frozen=True)
class Models:
    policy: ModelSpec
    reward: ModelSpec | None
    notes: tuple[str, ...] = ()
    """What could not be sized (e.g. a reward model whose config.json is not available), or was sized but
    cannot run as it is (what gpufleet check refuses)."""
    reward_said: str = ""
    """For the fits line: the reward model not counted, or counted though it cannot be one ('' when fine)."""


def _spec(path: str, env: Mapping[str, str], head: str) -> ModelSpec | str:
    from gpufleet.models.known import lookup_config

    found = lookup_config(path, env)
    if found is None:
        return "its config.json is not available offline (not a local folder, not in the Hugging Face cache, not a known model)"
    raw, source = found
    try:
        arch = arch_from_config(raw)
    except UnsupportedModel as e:
        return str(e)
    return ModelSpec(path, source, arch, count_parameters(arch, head))


def load_models(r: Resolved, env: Mapping[str, str]) -> Models:
    """The policy (and reward) model numbers. UserError naming model.path when the policy cannot be sized.
    A reward model that cannot be sized is left out, and one that cannot be a reward model (a causal LM:
    models/info.py `reward_head_problem`, what gpufleet check refuses) is counted with a one-label head;
    `notes` and `reward_said` say so."""
    policy = _spec(r.job.model.path, env, "causal_lm")
    if isinstance(policy, str):
        raise UserError(
            f"model.path = {r.job.model.path} ({r.source('model.path')}): {policy}.",
            fix=f"download it once (hf download {r.job.model.path}) or point model.path at a local "
            "folder with a config.json; gpufleet never downloads",
        )
    notes = [_no_weights("model.path", r.job.model.path)]
    reward, said, path = None, "", r.job.reward.model
    if path:
        got = _spec(path, env, "classifier")
        if isinstance(got, str):
            fetch = f" (hf download {path} config.json fetches it alone)" if looks_like_hub_id(path) else ""
            notes.append(f"reward.model {path}: {got}; its memory is not counted{fetch}")
            said = f"The reward model {path} is not counted: {got.split(' (')[0]}{fetch}"
        else:
            reward = got
            bad = _reward_head(path, env)
            if bad:
                notes.append(
                    f"reward.model {path}: {bad} gpufleet check refuses it; counted with a one-label head"
                )
                said = f"reward.model {path} cannot be a reward model (see the note); it is counted with a one-label head"
            notes.append(_no_weights("reward.model", path))
    return Models(policy, reward, tuple(n for n in notes if n), said)


def _reward_head(path: str, env: Mapping[str, str]) -> str:
    """Why the model at `path` cannot be a reward model ('' when it can, or when that is unknown)."""
    from gpufleet.models.known import lookup_config

    found = lookup_config(path, env)
    bad = reward_head_problem(found[0], path) if found else None
    return bad[0] if bad else ""


def _no_weights(field: str, path: str) -> str:
    """A note for a local model folder with no weights (a config.json alone): sized, but not loadable."""
    folder = user_path(path)
    if path.startswith("builtin:") or not folder.is_dir() or has_weights(folder):
        return ""
    return (
        f"{field} {path} holds no weights: counted from its config.json, but gpufleet check and train refuse "
        "the folder until they are there"
    )


def adapter_parameters(job, arch) -> int | None:
    """A LoRA run's adapter parameter count (None: every weight trains)."""
    if not job.model.use_peft:
        return None
    from gpufleet.models.lora import trainable_parameters

    return trainable_parameters(lora_config(arch), job.model)


def lora_config(arch) -> dict:
    """The config.json fields models/lora.py counts from."""
    return {
        "model_type": arch.model_type,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "vocab_size": arch.vocab_size,
    }
