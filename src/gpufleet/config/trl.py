"""TRL 1.16's `GRPOConfig` / `GRPOTrainer` option names and where each lives in a gpufleet job file: the
README's "Coming from TRL" map as a table (`tests/test_config_trl.py` keeps the two equal, name for name).

A job file key gpufleet does not know whose name is TRL's (`train.gradient_accumulation_steps`,
`output.save_steps`, a top-level `bf16:`) is reported with gpufleet's field for it, and the value to write
there where it can be computed; an option gpufleet has no equivalent for is named as such, never
guessed at. No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrlOption:
    """Where a TRL option lives in gpufleet: `field` (`section.field`; None: no equivalent), a short note
    on what differs, and `convert`: TRL's value -> gpufleet's (None: it cannot be computed from it)."""

    field: str | None
    note: str = ""
    convert: Callable[[Any], Any] | None = None
    fix: str = ""
    """The fix when the value cannot be converted; `{value}` is the value the job gave."""


def _same(value: Any) -> Any:
    return value


def _bool(value: Any) -> bool | None:
    """A YAML bool, or one given as text by a flag or the environment; None for anything else."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower() if isinstance(value, str) else ""
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(word)


def _precision(name: str) -> Callable[[Any], Any]:
    return lambda value: None if _bool(value) is None else (name if _bool(value) else "fp32")


def _engine(value: Any) -> Any:
    return None if _bool(value) is None else ("vllm" if _bool(value) else "hf")


def _resume(value: Any) -> Any:
    on = _bool(value)
    if on is not None:
        return "auto" if on else "never"
    return value if isinstance(value, str) else None


def _at(field: str, note: str = "", convert: Callable[[Any], Any] | None = _same, fix: str = "") -> TrlOption:
    return TrlOption(field, note, convert, fix)


def _none(note: str, fix: str = "") -> TrlOption:
    return TrlOption(None, note, None, fix)


_ALGO = (
    "num_generations beta epsilon epsilon_high delta sapo_temperature_pos sapo_temperature_neg vespo_k_pos "
    "vespo_lambda_pos vespo_k_neg vespo_lambda_neg off_policy_mask_threshold mask_truncated_completions "
    "num_iterations scale_rewards loss_type top_entropy_quantile entropy_coef use_adaptive_entropy "
    "entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target sync_ref_model ref_model_mixup_alpha "
    "ref_model_sync_steps"
).split()
_LORA = "lora_r lora_alpha lora_dropout lora_target_modules".split()
_OFFLOAD = "`params` (= `optimizer`): FSDP2's CPU offload, with placement.strategy: fsdp"

OPTIONS: dict[str, TrlOption] = {
    **{name: _at(f"algorithm.{name}") for name in _ALGO},
    **{name: _at(f"model.{name}") for name in _LORA},
    "model_init_kwargs": _at("model.dtype", "TRL's model_init_kwargs torch_dtype", None),
    "gradient_checkpointing": _at("model.gradient_checkpointing"),
    "use_peft": _at("model.use_peft"),
    "peft_config": _at(
        "model.use_peft",
        "LoRA through peft; its settings are model.lora_r, lora_alpha, lora_dropout, lora_target_modules",
        None,
    ),
    "environment_factory": _at(
        "env.name",
        "the class (or a dict of them) as module:Class / file.py:Class / file.py:DICT, with env.format: chat",
        None,
    ),
    "tools": _at(
        "rollout.tools",
        "module:function or file.py:function: on a plain dataset (TRL's tool loop), or in an env job with "
        "env.format: chat",
    ),
    "max_tool_calling_iterations": _at("rollout.max_tool_calling_iterations"),
    "chat_template_kwargs": _at("rollout.chat_template_kwargs"),
    "train_dataset": _at("data.path", "a file, a hub dataset or builtin:<task>", None),
    "shuffle_dataset": _at("data.shuffle"),
    "reward_funcs": _at("reward.functions", "module:function or file.py:function"),
    "reward_weights": _at("reward.weights"),
    "multi_objective_aggregation": _at("reward.aggregation"),
    "use_bias_correction_kl": _at("algorithm.kl_bias_correction"),
    "importance_sampling_level": _at("algorithm.importance_level"),
    "max_completion_length": _at("rollout.max_completion_length"),
    "temperature": _at("rollout.temperature"),
    "top_p": _at("rollout.top_p"),
    "top_k": _at("rollout.top_k"),
    "use_vllm": _at("rollout.engine", "hf or vllm; vllm is not available yet", _engine),
    "vllm_tensor_parallel_size": _at("rollout.tensor_parallel_size"),
    "vllm_importance_sampling_correction": _at(
        "algorithm.importance_sampling_correction", "for a dedicated rollout rank (placement.rollout)"
    ),
    "vllm_importance_sampling_mode": _at("algorithm.importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": _at("algorithm.importance_sampling_clip_max"),
    "vllm_importance_sampling_clip_min": _at("algorithm.importance_sampling_clip_min"),
    "vllm_importance_sampling_cap": _at("algorithm.importance_sampling_clip_max", "TRL's deprecated name"),
    "per_device_train_batch_size": _at("train.per_device_batch", "completions per device, as in TRL"),
    "gradient_accumulation_steps": _at(
        "train.micro_batch",
        "gpufleet accumulates per_device_batch / micro_batch micro-batches per optimizer step",
        None,
        "set train.micro_batch to train.per_device_batch / {value}",
    ),
    "generation_batch_size": _none(
        "it is derived as train.per_device_batch x policy ranks x train.steps_per_generation "
        "(gpufleet check prints it)",
        "remove it; set train.per_device_batch (and train.steps_per_generation) instead",
    ),
    "steps_per_generation": _at("train.steps_per_generation"),
    "learning_rate": _at("train.learning_rate"),
    "lr_scheduler_type": _at("train.lr_scheduler", "constant, linear or cosine"),
    "warmup_steps": _at("train.warmup_steps"),
    "weight_decay": _at("train.weight_decay"),
    "max_grad_norm": _at("train.max_grad_norm"),
    "max_steps": _at("train.max_steps"),
    "num_train_epochs": _at(
        "train.max_steps",
        "gpufleet counts optimizer steps, not epochs",
        None,
        "set train.max_steps to the optimizer steps of {value} epochs",
    ),
    "seed": _at("train.seed"),
    "bf16": _at("train.precision", "fp32, bf16 or fp16, with fp32 master weights", _precision("bf16")),
    "fp16": _at("train.precision", "fp32, bf16 or fp16, with fp32 master weights", _precision("fp16")),
    "torch_compile": _at("train.torch_compile"),
    "fsdp_config": _at("placement.offload", f"{_OFFLOAD}; FSDP itself is placement.strategy: fsdp", None),
    "offload_param": _at("placement.offload", _OFFLOAD, None),
    "offload_optimizer": _at("placement.offload", _OFFLOAD, None),
    "logging_steps": _at("train.log_every", "metrics.jsonl gets a line every log_every steps"),
    "log_completions": _at(
        "train.samples_every", "steps between two writes of samples.jsonl (0: never)", None
    ),
    "output_dir": _at("output.dir"),
    "save_steps": _at("output.save_every"),
    "save_total_limit": _at("output.keep_last"),
    "resume_from_checkpoint": _at("output.resume", "auto, never, or a checkpoint's path", _resume),
    "min_p": _none("min_p sampling is not available yet (rollout has temperature, top_p, top_k)"),
    "repetition_penalty": _none("a repetition penalty is not available yet"),
    "report_to": _none(
        "metrics always go to metrics.jsonl; monitor.tensorboard and monitor.wandb add TensorBoard and "
        "Weights & Biases"
    ),
}
"""TRL option name -> where it lives in gpufleet."""

PREFIXES: dict[str, TrlOption] = {
    "vllm_": _none("vLLM options wait for the vLLM engine (rollout.engine: vllm is not available yet)"),
}
"""Families of TRL options (`vllm_*`) matched by their prefix, after OPTIONS."""


def lookup(name: str) -> TrlOption | None:
    """Where TRL's option `name` lives in gpufleet; None when `name` is not a TRL option."""
    key = name.strip().lower()
    if key in OPTIONS:
        return OPTIONS[key]
    for prefix, option in PREFIXES.items():
        if key.startswith(prefix):
            return option
    return None
