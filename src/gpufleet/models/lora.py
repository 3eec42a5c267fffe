"""LoRA through peft (`model.use_peft`): put an adapter on the policy, load one from a checkpoint, merge.

The base model stays frozen; only the adapter's A and B matrices train (gradients and AdamW state for
them alone). The KL reference is the same model with the adapter switched off (`reference_logprobs`
in rl/step.py uses `disable_adapter()`), so no second copy of the weights exists. A checkpoint, and the
run's `final/`, is peft's adapter folder (adapter_config.json + adapter_model.safetensors + the
tokenizer); `merged` writes base + adapter as one ordinary model folder for from_pretrained and vLLM.

`trainable_parameters` counts the adapter from config.json alone (no torch) for the planner; a test
holds it equal to peft's own count on the real model. torch / peft are imported inside the functions.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from gpufleet.errors import UserError

# peft reads `model.is_gradient_checkpointing`, which transformers 5.23 deprecates (FutureWarning on
# every PeftModel): a message about the libraries' versions, nothing the user can act on.
warnings.filterwarnings(
    "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
)

DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    t: ("q_proj", "v_proj") for t in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3")
}
"""peft's default target modules for the architectures gpufleet plans (its
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); other types need model.lora_target_modules."""

ADAPTER_CONFIG = "adapter_config.json"


def targets(model_section, model_type: str | None) -> list[str] | str:
    """The modules that get an adapter: the job's, else peft's default for the architecture."""
    given = model_section.lora_target_modules
    if given:
        return "all-linear" if list(given) == ["all-linear"] else list(given)
    if model_type in DEFAULT_TARGETS:
        return list(DEFAULT_TARGETS[model_type])
    raise UserError(
        f"model.use_peft: peft has no default LoRA target modules for model_type {model_type!r}.",
        field="model.lora_target_modules",
        fix="--set model.lora_target_modules=all-linear (or the names of the projections to adapt)",
    )


TIED_HEAD_WARNING = r"Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"
"""peft's warning for an adapter on a head tied to the input embeddings. Safe here: the adapter adds to the
head's output only (the shared matrix stays frozen, the embeddings unchanged), and `merged` unties the head
before merging, so the merge cannot change the embeddings either."""


def apply(model, model_section, adapter: Path | None = None):
    """`model` with a fresh LoRA adapter (the job's settings), or with the adapter saved in `adapter`
    (a checkpoint: resume continues from its exact weights), trainable.

    Its save_pretrained leaves the base's embedding and head weights out (save_embedding_layers=False):
    they are frozen and loaded from the base model. peft's "auto" saved the whole vocab x hidden matrix into
    every adapter whose targets name lm_head (1 GiB a checkpoint on Qwen2.5-7B), with a warning."""
    import functools

    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TIED_HEAD_WARNING, category=UserWarning)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        else:
            m = model_section
            config = LoraConfig(
                r=m.lora_r,
                lora_alpha=m.lora_alpha,
                lora_dropout=m.lora_dropout,
                target_modules=targets(m, getattr(model.config, "model_type", None)),
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, config)
    model.save_pretrained = functools.partial(model.save_pretrained, save_embedding_layers=False)
    return model


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def base_of(adapter: Path) -> str:
    """The base model an adapter folder was trained on (its adapter_config.json)."""
    import json

    base = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise UserError(
            f"{adapter / ADAPTER_CONFIG} does not name its base model.",
            field="--merge",
            fix="merge by hand: PeftModel.from_pretrained(base, adapter).merge_and_unload()",
        )
    return base


def merged(adapter: Path, base: str, to: Path, min_new_tokens: int = 0) -> None:
    """Base model + the adapter in `adapter`, merged, saved to `to` (with the tokenizer), every file readable
    by all (0644 under umask 022; safetensors writes 0600). An adapter on an output head tied to the input
    embeddings adapts the head alone: the merged model gets its own head (untied), else merging would
    change the embeddings too. Its generation config says what training sampled, as a trained model's
    does: `suppress_tokens` (a pad that is not EOS) and `min_new_tokens` (rollout.min_completion_length)."""
    import json

    from peft import PeftModel

    from gpufleet.checkpoint import readable_by_all
    from gpufleet.engine.sampling import mark_generation_config
    from gpufleet.models.load import load_causal_lm, load_tokenizer

    model = load_causal_lm(base)
    chosen = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("target_modules") or []
    if HEAD in chosen and getattr(model.config, "tie_word_embeddings", False):
        _untie_head(model)
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tokenizer = load_tokenizer(str(adapter) if (adapter / "tokenizer_config.json").is_file() else base)
    mark_generation_config(tokenizer, model, min_new_tokens)  # as the policy's in training (rl/parts.py)
    model.save_pretrained(to, safe_serialization=True)
    tokenizer.save_pretrained(to)
    readable_by_all(to)


def _untie_head(model) -> None:
    """Give a tied output head its own copy of the embedding matrix (config says so when saved)."""
    import torch

    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one decoder layer of a Llama-family config."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    return {
        "q_proj": (h, heads * d),
        "k_proj": (h, kv * d),
        "v_proj": (h, kv * d),
        "o_proj": (heads * d, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


HEAD = "lm_head"
"""The output head: an adapter target of its own (peft's all-linear leaves it out; name it to adapt it)."""


def adapted_width(config: dict[str, Any], model_section) -> int:
    """r x the projections that get an adapter, over all layers (the A outputs kept per token); the
    head's adapter, on the completion positions only, is left out."""
    shapes = linear_shapes(config)
    chosen = targets(model_section, config.get("model_type"))
    names = list(shapes) if chosen == "all-linear" else [n for n in chosen if n in shapes]
    return model_section.lora_r * len(names) * config["num_hidden_layers"]


def trainable_parameters(config: dict[str, Any], model_section) -> int:
    """The adapter's parameter count: r x (in + out) per adapted projection per layer (all-linear: every
    projection of the decoder layers; peft leaves the output head alone), plus r x (hidden + vocab) once
    when `lm_head` is named."""
    shapes = linear_shapes(config)
    chosen = targets(model_section, config.get("model_type"))
    names = list(shapes) if chosen == "all-linear" else [n for n in chosen if n in shapes]
    unknown = [] if chosen == "all-linear" else [n for n in chosen if n not in shapes and n != HEAD]
    if unknown:
        raise UserError(
            f"model.lora_target_modules names {', '.join(unknown)}, not a projection of a decoder layer "
            f"({', '.join(shapes)}) nor {HEAD}.",
            field="model.lora_target_modules",
            fix="use those names, or all-linear",
        )
    r = model_section.lora_r
    per_layer = sum(r * (shapes[n][0] + shapes[n][1]) for n in names)
    head = (
        r * (config["hidden_size"] + config["vocab_size"]) if chosen != "all-linear" and HEAD in chosen else 0
    )
    return per_layer * config["num_hidden_layers"] + head
