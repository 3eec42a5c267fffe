"""TRL 1.16's `GRPOConfig` / `GRPOTrainer` option names (every GRPOConfig field, and the TrainingArguments
fields a GRPO job sets) and where each lives in a gpufleet job file: the guide's "Coming from TRL" map
(docs/trl.md) as a table (`tests/test_config_trl.py` keeps the two equal, name for name, and holds TRL
1.16's field list).

A job file key gpufleet does not know whose name is TRL's (`train.gradient_accumulation_steps`,
`output.save_steps`, a top-level `bf16:`) is reported with gpufleet's field for it, and the value to write
there where it can be computed (with the other settings it depends on: trl_values.py); an option gpufleet has
no equivalent for is named as such, never guessed at. No torch import.
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


def as_bool(value: Any) -> bool | None:
    """A YAML bool, or one given as text by a flag or the environment; None for anything else."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower() if isinstance(value, str) else ""
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(word)


def _precision(name: str) -> Callable[[Any], Any]:
    return lambda value: None if as_bool(value) is None else (name if as_bool(value) else "fp32")


def _engine(value: Any) -> Any:
    """`use_vllm: false` is rollout.engine: hf; true has no value to copy (vLLM is not available yet)."""
    return "hf" if as_bool(value) is False else None


def _dtype(value: Any) -> Any:
    """transformers' torch_dtype (`bfloat16`, `torch.bfloat16`) where model.dtype has it; `auto` is not
    gpufleet's auto (the checkpoint's dtype there, float32 master weights here): no value to copy."""
    name = str(value).strip().lower().removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else None


def _resume(value: Any) -> Any:
    on = as_bool(value)
    if on is not None:
        return "auto" if on else "never"
    return value if isinstance(value, str) else None


def _vllm_mode(value: Any) -> Any:
    """TRL's colocate is gpufleet's; its server mode has no value to copy (the rollout ranks' device ids)."""
    return "colocate" if str(value).strip().lower() == "colocate" else None


def _fsdp(value: Any) -> Any:
    """TRL's `fsdp` (a bool, or a string of FSDP options such as `full_shard auto_wrap`)."""
    on = as_bool(value)
    if on is None and isinstance(value, str):
        on = bool(value.strip())
    return None if on is None else ("fsdp" if on else "ddp")


def _scheduler(value: Any) -> Any:
    """TRL's lr_scheduler_type where gpufleet has it (constant_with_warmup: constant after train.warmup_steps)."""
    name = str(value).strip().lower()
    return {"constant_with_warmup": "constant"}.get(
        name, name if name in ("constant", "linear", "cosine") else None
    )


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
_VLLM = "vLLM options wait for the vLLM engine (rollout.engine: vllm is not available yet)"
_SERVER = (
    "there is no generation server to reach: dedicated rollout ranks (placement.rollout device ids) are "
    "started by the job and get the weights over its own process group (launch.master_port, "
    "launch.collective_timeout)"
)
_NO_EVAL = "gpufleet does not evaluate during training yet (no eval data set, no eval steps)"
_LOADER = "prompts are read by the trainer process itself, without a DataLoader (no workers, no rows dropped)"
_HF_GENERATE = (
    "gpufleet samples with its own batched decoder (rollout.engine: hf), not transformers' generate"
)

_DTYPE = _at(
    "model.dtype",
    "float32, bfloat16 or float16; gpufleet's auto is float32 master weights, TRL's the checkpoint's dtype",
    _dtype,
    "set model.dtype to bfloat16, float16 or float32",
)
"""ModelConfig.dtype and transformers' torch_dtype."""

OPTIONS: dict[str, TrlOption] = {
    **{name: _at(f"algorithm.{name}") for name in _ALGO},
    **{name: _at(f"model.{name}") for name in _LORA},
    "model_init_kwargs": _at("model.dtype", "TRL's model_init_kwargs torch_dtype", None),
    "model_name_or_path": _at("model.path", "a hub id, a local folder or builtin:<name>"),
    "model_revision": _none(
        "a hub id loads the revision in the local Hugging Face cache (main)",
        "remove it; for another revision: hf download ID --revision REV --local-dir DIR, then set model.path "
        "to DIR",
    ),
    **{name: _DTYPE for name in ("dtype", "torch_dtype")},
    "attn_implementation": _none(
        "the attention is transformers' default for the model (sdpa); others (flash_attention_2, kernels) are "
        "not available yet"
    ),
    "lora_modules_to_save": _none(
        "only the LoRA adapters train (on model.lora_target_modules); every other module (lm_head, "
        "embed_tokens) stays frozen, and training modules beside the adapters is not available yet"
    ),
    "lora_target_parameters": _none(
        "adapters go on modules (model.lora_target_modules); adapters on parameters are not available yet"
    ),
    "lora_task_type": _none("always CAUSAL_LM: the policy is a causal language model"),
    "use_rslora": _none(
        "LoRA's scaling is lora_alpha / lora_r; rank-stabilised scaling is not available yet"
    ),
    "use_dora": _none("model.use_peft trains plain LoRA adapters; DoRA is not available yet"),
    **{
        name: _none(
            "quantized (bitsandbytes) base models are not available yet; model.dtype sets the weights' dtype"
        )
        for name in "load_in_8bit load_in_4bit bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage".split()
    },
    "trust_remote_code": _none(
        "only architectures transformers ships load; code that comes with a model is never run"
    ),
    "router_aux_loss_coef": _at("algorithm.router_aux_loss_coef"),
    "disable_dropout": _none(
        "sampling, the reference and the reward model run in eval mode (no dropout); the training forward "
        "keeps the model's own dropout (0 in Llama / Qwen / Mistral configs; LoRA's is model.lora_dropout), "
        "as TRL's default does"
    ),
    "cast_lm_head_to_fp32": _none(
        "the head runs in train.precision (fp32 by default: an fp32 head) and its logits are cast to fp32 "
        "before the log-softmax; an fp32 head in a bf16 / fp16 job is not available yet"
    ),
    "activation_checkpointing": _at("model.gradient_checkpointing", "transformers 5's name"),
    "gradient_checkpointing_kwargs": _none(
        "model.gradient_checkpointing always checkpoints every decoder layer, non-reentrant"
    ),
    "activation_checkpointing_kwargs": _none(
        "every_n_layers and offload are not available yet: model.gradient_checkpointing checkpoints every "
        "decoder layer"
    ),
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
    "remove_unused_columns": _none(
        "every column of the data set reaches the reward functions (TRL's GRPO default)"
    ),
    "pad_to_multiple_of": _none(
        "rows are padded to the longest row of their batch, never to a multiple (TRL's default off AWS Neuron)"
    ),
    "data_seed": _none("train.seed orders the prompts too (a seeded permutation per epoch)"),
    "dataloader_num_workers": _none(_LOADER),
    "dataloader_pin_memory": _none(_LOADER),
    "dataloader_drop_last": _none(_LOADER),
    **{
        name: _none(_NO_EVAL)
        for name in (
            "eval_dataset num_generations_eval eval_strategy eval_steps per_device_eval_batch_size "
            "eval_on_start load_best_model_at_end metric_for_best_model"
        ).split()
    },
    "reward_funcs": _at("reward.functions", "module:function or file.py:function"),
    "reward_weights": _at("reward.weights"),
    "multi_objective_aggregation": _at("reward.aggregation"),
    "use_bias_correction_kl": _at("algorithm.kl_bias_correction"),
    "importance_sampling_level": _at("algorithm.importance_level"),
    "max_completion_length": _at("rollout.max_completion_length"),
    "temperature": _at("rollout.temperature"),
    "top_p": _at("rollout.top_p"),
    "top_k": _at("rollout.top_k"),
    "generation_kwargs": _none(
        "more sampling settings are not available yet: rollout has temperature, top_p, top_k and "
        "min_completion_length (min_new_tokens)"
    ),
    "cache_implementation": _none(f"{_HF_GENERATE}, with its own KV cache"),
    "use_transformers_continuous_batching": _none(_HF_GENERATE),
    "transformers_continuous_batching_config": _none(_HF_GENERATE),
    "use_transformers_paged": _none(_HF_GENERATE),
    "ds3_gather_for_generation": _none(
        "under placement.strategy: fsdp sampling runs the sharded model, each layer gathered as it runs "
        "(TRL's False); a whole copy samples on dedicated rollout ranks (placement.rollout device ids)"
    ),
    "use_vllm": _at(
        "rollout.engine",
        "hf or vllm; vllm is not available yet",
        _engine,
        "remove it: vLLM is not available yet; gpufleet samples with its own batched decoder and KV cache "
        "(rollout.engine: hf, the default), on the policy's ranks or on dedicated rollout ranks "
        "(placement.rollout device ids)",
    ),
    "vllm_mode": _at(
        "placement.rollout",
        "where sampling runs: colocate, or the device ids of dedicated rollout ranks that the job starts "
        "itself; no vLLM server, the engine is gpufleet's own",
        _vllm_mode,
        "set placement.rollout to the device ids of the rollout ranks",
    ),
    **{
        name: _none(_VLLM)
        for name in (
            "vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_gpu_memory_utilization"
        ).split()
    },
    **{
        name: _none(_SERVER)
        for name in (
            "vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port"
        ).split()
    },
    "vllm_max_model_length": _none(
        "the sampler's context is derived: rollout.max_prompt_length + rollout.max_completion_length",
        "remove it; set rollout.max_prompt_length and rollout.max_completion_length instead",
    ),
    "vllm_tensor_parallel_size": _at("rollout.tensor_parallel_size"),
    "vllm_importance_sampling_correction": _at(
        "algorithm.importance_sampling_correction", "for a dedicated rollout rank (placement.rollout)"
    ),
    "vllm_importance_sampling_mode": _at("algorithm.importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": _at("algorithm.importance_sampling_clip_max"),
    "vllm_importance_sampling_clip_min": _at("algorithm.importance_sampling_clip_min"),
    "vllm_importance_sampling_cap": _at("algorithm.importance_sampling_clip_max", "TRL's deprecated name"),
    "per_device_train_batch_size": _at(
        "train.per_device_batch",
        "TRL's counts the completions of one forward pass, gpufleet's those of one optimizer step: TRL's x "
        "gradient_accumulation_steps; TRL's own value is train.micro_batch",
    ),
    "gradient_accumulation_steps": _at(
        "train.micro_batch",
        "gpufleet accumulates per_device_batch / micro_batch micro-batches per optimizer step",
        None,
    ),
    "generation_batch_size": _none(
        "it is derived as train.per_device_batch x policy ranks x train.steps_per_generation "
        "(gpufleet check prints it)",
        "remove it; set train.per_device_batch (and train.steps_per_generation) instead",
    ),
    "steps_per_generation": _at(
        "train.steps_per_generation",
        "gpufleet counts optimizer steps, TRL forward passes: TRL's / gradient_accumulation_steps",
    ),
    "learning_rate": _at("train.learning_rate"),
    "lr_scheduler_type": _at(
        "train.lr_scheduler",
        "constant, linear or cosine",
        _scheduler,
        "set train.lr_scheduler to constant, linear or cosine",
    ),
    "lr_scheduler_kwargs": _none(
        "train.lr_scheduler takes no arguments yet (cosine and linear decay to 0 at train.max_steps)"
    ),
    "optim": _none("AdamW (torch's, fused where the parameters allow it) is the only optimizer yet"),
    "adam_beta1": _at("train.adam_beta1"),
    "adam_beta2": _at("train.adam_beta2"),
    "adam_epsilon": _at("train.adam_epsilon"),
    "average_tokens_across_devices": _none(
        "token-level losses are always normalised by the token count over all policy ranks (TRL's default)"
    ),
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
    "tf32": _none("not settable yet: PyTorch's default (fp32 matmuls without TF32)"),
    "full_determinism": _none(
        "torch's deterministic algorithms are not switched on yet; sampling is seeded per completion from "
        "train.seed, so results do not depend on the rank count"
    ),
    "use_cpu": _none(
        "a flag, not a job field: gpufleet train JOB --gpus cpu", "remove it; run with --gpus cpu"
    ),
    "torch_compile": _at("train.torch_compile"),
    "torch_compile_backend": _none(
        "train.torch_compile always uses TorchInductor (default mode, dynamic shapes)"
    ),
    "torch_compile_mode": _none(
        "train.torch_compile always uses TorchInductor (default mode, dynamic shapes)"
    ),
    "use_liger_kernel": _none(
        "Liger's kernels are not used; log-probs come from gpufleet's chunked head (no batch x vocab logits)"
    ),
    "torch_empty_cache_steps": _none("gpufleet never empties the CUDA cache between steps"),
    "fsdp": _at("placement.strategy", "ddp or fsdp (FSDP2)", _fsdp),
    "deepspeed": _at(
        "placement.strategy",
        "ZeRO-3 shards as fsdp does; ZeRO-1/2 (optimizer states sharded only) are not available",
        None,
        "set placement.strategy to fsdp (ZeRO-3's sharding) or ddp instead",
    ),
    "ddp_timeout": _at("launch.collective_timeout", "seconds a collective may wait; TRL's default is 1800"),
    "fsdp_config": _at("placement.offload", f"{_OFFLOAD}; FSDP itself is placement.strategy: fsdp", None),
    "offload_param": _at("placement.offload", _OFFLOAD, None),
    "offload_optimizer": _at("placement.offload", _OFFLOAD, None),
    "logging_steps": _at("train.log_every", "metrics.jsonl gets a line every log_every steps"),
    "log_completions": _at(
        "train.samples_every", "steps between two writes of samples.jsonl (0: never)", None
    ),
    "logging_strategy": _none("metrics.jsonl gets every step; the progress line every train.log_every steps"),
    "num_completions_to_print": _none(
        "samples.jsonl gets 4 completions (the first rows of rank 0's batch) every train.samples_every "
        "steps; the count is not settable yet"
    ),
    "log_unique_prompts": _none(
        "samples.jsonl gets the first 4 rows of rank 0's batch (groups are kept together, so they often "
        "share a prompt); unique prompts are not available yet"
    ),
    "log_multimodal": _none("gpufleet trains text-only models"),
    "log_completions_hub_repo": _none("completions stay in OUTPUT/samples.jsonl; nothing is uploaded"),
    "push_to_hub": _none("nothing is uploaded: gpufleet export writes a Hugging Face folder to upload"),
    "hub_model_id": _none("nothing is uploaded: gpufleet export writes a Hugging Face folder to upload"),
    "run_name": _none("a run is named by output.dir's folder (the W&B run too)"),
    "output_dir": _at("output.dir"),
    "save_steps": _at("output.save_every"),
    "save_total_limit": _at("output.keep_last"),
    "save_strategy": _at(
        "output.save_every", "a checkpoint every save_every steps (0: only at the end)", None
    ),
    "save_only_model": _none(
        "checkpoints always hold the optimizer and RNG states, for exact resume; final/ and gpufleet export "
        "hold the model only"
    ),
    "resume_from_checkpoint": _at("output.resume", "auto, never, or a checkpoint's path", _resume),
    "min_p": _none("min_p sampling is not available yet (rollout has temperature, top_p, top_k)"),
    "repetition_penalty": _none("a repetition penalty is not available yet"),
    "report_to": _none(
        "metrics always go to metrics.jsonl; monitor.tensorboard and monitor.wandb add TensorBoard and "
        "Weights & Biases",
        "set monitor.tensorboard: true and/or monitor.wandb: true instead",
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
