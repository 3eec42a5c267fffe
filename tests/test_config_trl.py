"""TRL's option names in a job file: the key is reported with gpufleet's field for it (the guide's "Coming
from TRL" map, docs/trl.md, `gpufleet.config.trl`), or as having no equivalent, never with a wrong "did you mean"; and
fields that have no effect in a job (env: without an env, script: in a trainer job) are warned about.
Through the installed `gpufleet` from a folder outside the repository, with the user's own job.yaml."""

from __future__ import annotations

import re
from pathlib import Path

from gpufleet.config.schema import SECTIONS, field_paths
from gpufleet.config.trl import OPTIONS, PREFIXES, lookup
from helpers import run_user

ROOT = Path(__file__).resolve().parents[1]


def _readme_trl_rows() -> list[tuple[str, str]]:
    """(TRL cell, gpufleet cell) of every row of the guide's "Coming from TRL" table (docs/trl.md)."""
    text = (ROOT / "docs" / "trl.md").read_text(encoding="utf-8")
    block = text.split("# Coming from TRL", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in block.splitlines():
        if not line.startswith("| ") or line.startswith(("| TRL 1.16", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append((cells[0], cells[1]))
    assert len(rows) > 40, "the TRL map in docs/trl.md was not found"
    return rows


def _trl_names(cell: str) -> list[str]:
    """TRL option names in a README cell: each backticked name (`ModelConfig.` dropped, cut at `=`, `(`, `:`);
    class names (GRPOTrainer(...)) are not options; `vllm_*` is a family."""
    names = []
    for span in re.findall(r"`([^`]+)`", cell):
        span = span.removeprefix("ModelConfig.")
        name = re.match(r"[A-Za-z_][A-Za-z0-9_]*\*?", span)
        if name and not name.group(0)[0].isupper():
            names.append(name.group(0))
    return names


def _gpufleet_fields(cell: str, trl_name: str) -> set[str]:
    """The job fields a README gpufleet cell names (`algorithm.` + the same names, `algorithm.vespo_*`)."""
    spans = re.findall(r"`([^`]+)`", cell)
    out = {s for s in spans if s in field_paths()}
    for s in spans:
        if s.endswith("*"):
            out |= {p for p in field_paths() if p.startswith(s[:-1])}
        if s.endswith(":") and s[:-1] in SECTIONS:  # `env:` section
            out |= {p for p in field_paths() if p.startswith(s[:-1] + ".")}
    if "+ the same names" in cell:
        out |= {s + trl_name for s in spans if s.endswith(".")}
    return out


def test_readme_trl_map_and_the_table_name_the_same_options():
    """Every TRL name in the README's map is in gpufleet.config.trl and vice versa, and both send it to the
    same field (or both say there is none)."""
    seen: set[str] = set()
    for trl_cell, gpufleet_cell in _readme_trl_rows():
        for name in _trl_names(trl_cell):
            seen.add(name)
            if name.endswith("*"):
                assert any(name[:-1].startswith(p) for p in PREFIXES), f"README's {name} is not in PREFIXES"
                continue
            assert name in OPTIONS, f"README's TRL map names {name!r}; add it to gpufleet.config.trl.OPTIONS"
            option = OPTIONS[name]
            fields = _gpufleet_fields(gpufleet_cell, name)
            if option.field is None:
                assert not fields or "not yet" in gpufleet_cell or "derived" in gpufleet_cell, (name, fields)
            else:
                assert option.field in fields, f"{name}: table says {option.field}, README says {fields}"
    missing = set(OPTIONS) - seen
    assert not missing, f"in gpufleet.config.trl but not in the README's TRL map: {sorted(missing)}"
    assert all(any(n.endswith("*") and n[:-1].startswith(p) for n in seen) for p in PREFIXES)


# TRL 1.16.0's `GRPOConfig` fields that are not `transformers.TrainingArguments` (5.23) fields, in file order.
# trl is not installed in the test venv; produced with the bench venv (TRL 1.16.0, transformers 5.23.0):
#   python -c "from trl import GRPOConfig; from transformers import TrainingArguments; import dataclasses;
#     base = {f.name for f in dataclasses.fields(TrainingArguments)};
#     print(' '.join(f.name for f in dataclasses.fields(GRPOConfig) if f.name not in base))"
TRL_GRPO_OWN_FIELDS = """
model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32 num_generations
num_generations_eval max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of
generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs
repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta num_iterations
epsilon delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg
vespo_lambda_neg importance_sampling_level reward_weights multi_objective_aggregation scale_rewards loss_type
mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile
entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
max_tool_calling_iterations vllm_importance_sampling_correction vllm_importance_sampling_mode
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min off_policy_mask_threshold
use_bias_correction_kl log_completions log_multimodal num_completions_to_print log_unique_prompts
log_completions_hub_repo use_transformers_continuous_batching transformers_continuous_batching_config
use_transformers_paged vllm_importance_sampling_cap
""".split()

# The `TrainingArguments` fields (transformers 5.23, as `GRPOConfig` inherits them) a GRPO job sets: batch,
# schedule, optimizer, precision, checkpointing, compile, logging, eval, saving, hub, seeds, data loading,
# distribution and resume. The rest (hub tokens, log levels, label smoothing, predict/eval internals, ...)
# plays no part in a GRPO job. Chosen by hand from `dataclasses.fields(TrainingArguments)`.
TRAINING_ARGUMENTS_A_GRPO_JOB_SETS = """
output_dir per_device_train_batch_size gradient_accumulation_steps num_train_epochs max_steps learning_rate
lr_scheduler_type lr_scheduler_kwargs warmup_steps optim weight_decay adam_beta1 adam_beta2 adam_epsilon
max_grad_norm average_tokens_across_devices bf16 fp16 tf32 gradient_checkpointing gradient_checkpointing_kwargs
activation_checkpointing activation_checkpointing_kwargs torch_compile torch_compile_backend torch_compile_mode
use_liger_kernel torch_empty_cache_steps logging_steps logging_strategy report_to run_name eval_strategy
eval_steps per_device_eval_batch_size eval_on_start save_strategy save_steps save_total_limit save_only_model
push_to_hub hub_model_id load_best_model_at_end metric_for_best_model seed data_seed full_determinism use_cpu
dataloader_num_workers dataloader_pin_memory dataloader_drop_last remove_unused_columns ddp_timeout fsdp
fsdp_config deepspeed resume_from_checkpoint
""".split()


# TRL 1.16's `ModelConfig` fields (trl/trainer/model_config.py, the model options of `trl grpo`), and transformers'
# older `torch_dtype` that TRL examples still write.
TRL_MODEL_CONFIG_FIELDS = """
model_name_or_path model_revision dtype attn_implementation use_peft lora_r lora_alpha lora_dropout
lora_target_modules lora_target_parameters lora_modules_to_save lora_task_type use_rslora use_dora load_in_8bit
load_in_4bit bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage torch_dtype
""".split()


def test_every_trl_option_is_in_the_map_and_known_to_check():
    """Every field of TRL 1.16's GRPOConfig, and every TrainingArguments field a GRPO job sets, has a row
    of its own name in docs/trl.md and an entry in gpufleet.config.trl (not only the `vllm_*` family), so
    `gpufleet check` answers it in a job file; a TRL option added to these lists fails until it is mapped."""
    assert len(TRL_GRPO_OWN_FIELDS) == 77 and len(set(TRL_GRPO_OWN_FIELDS)) == 77
    named = {name for trl_cell, _ in _readme_trl_rows() for name in _trl_names(trl_cell)}
    for kind, names in (
        ("GRPOConfig", TRL_GRPO_OWN_FIELDS),
        ("TrainingArguments", TRAINING_ARGUMENTS_A_GRPO_JOB_SETS),
        ("ModelConfig", TRL_MODEL_CONFIG_FIELDS),
    ):
        missing = [n for n in names if n not in named]
        assert not missing, f"TRL 1.16 {kind} fields not named in docs/trl.md's map: {missing}"
        unknown = [n for n in names if n not in OPTIONS]
        assert not unknown, f"TRL 1.16 {kind} fields not in gpufleet.config.trl.OPTIONS: {unknown}"
    for name, option in OPTIONS.items():  # what `check` prints about it says something
        assert option.field is not None or len(option.note) > 20, name


def test_every_target_is_a_job_field():
    paths = set(field_paths())
    for name, option in {**OPTIONS, **PREFIXES}.items():
        assert option.field is None or option.field in paths, (name, option.field)
        assert lookup(name) is option or name in PREFIXES
    assert lookup("vllm_some_future_option") is PREFIXES["vllm_"]  # a vllm_* name TRL 1.16 does not have
    assert lookup("vllm_tensor_parallel_size").field == "rollout.tensor_parallel_size"  # exact before family


TRL_JOB = """\
model:
  path: builtin:tiny-qwen2
  disable_dropout: true
train:
  gradient_accumulation_steps: 4
  logging_steps: 5
  bf16: true
  learning_rat: 1.0e-5
  lr_scheduler_type: constant_with_warmup
  optim: paged_adamw_8bit
  fsdp: full_shard auto_wrap
reward:
  reward_weights: [1.0]
  multi_objective_aggregation: normalize_then_sum
output:
  save_steps: 10
  save_total_limit: 3
rollout:
  vllm_gpu_memory_utilization: 0.5
  min_p: 0.1
  vllm_mode: colocate
  vllm_server_port: 8000
  vllm_max_model_length: 4096
algorithm:
  generation_batch_size: 16
bf16: true
logging_steps: 3
"""


def _blocks(text: str) -> dict[str, str]:
    """check's output: the field of each problem -> its three lines."""
    out, key = {}, None
    for line in text.splitlines():
        if line.startswith(("error: ", "warning: ")):
            key = line.split(": ", 2)[1]
            out[key] = line
        elif key and line.startswith("    "):
            out[key] += "\n" + line
    return out


def test_trl_names_point_at_gpufleet_fields(tmp_path):
    (tmp_path / "job.yaml").write_text(TRL_JOB)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    said = _blocks(p.stdout)
    expect = {
        "train.gradient_accumulation_steps": (
            "gpufleet's is `train.micro_batch`",
            "write `per_device_batch: 32` and `micro_batch: 8` under `train:`",  # TRL's default batch 8, x 4
        ),
        "train.logging_steps": ("gpufleet's is `train.log_every`", "write `log_every: 5` under `train:`"),
        "train.bf16": ("gpufleet's is `train.precision`", "write `precision: bf16` under `train:`"),
        "reward.reward_weights": ("gpufleet's is `reward.weights`", "write `weights: [1.0]` under `reward:`"),
        "reward.multi_objective_aggregation": (
            "gpufleet's is `reward.aggregation`",
            "write `aggregation: normalize_then_sum` under `reward:`",
        ),
        "output.save_steps": ("gpufleet's is `output.save_every`", "write `save_every: 10` under `output:`"),
        "output.save_total_limit": (
            "gpufleet's is `output.keep_last`",
            "write `keep_last: 3` under `output:`",
        ),
        "bf16": ("gpufleet's is `train.precision`", "write `precision: bf16` under `train:`"),
        "logging_steps": ("gpufleet's is `train.log_every`", "write `log_every: 3` under `train:`"),
        "train.lr_scheduler_type": (
            "gpufleet's is `train.lr_scheduler`",
            "write `lr_scheduler: constant` under `train:`",
        ),
        "train.fsdp": ("gpufleet's is `placement.strategy`", "write `strategy: fsdp` under `placement:`"),
        "rollout.vllm_mode": (
            "gpufleet's is `placement.rollout`",
            "write `rollout: colocate` under `placement:`",
        ),
    }
    for key, (why, fix) in expect.items():
        block = said[key]
        assert f"`{key}` is TRL's name: {why}" in block and f"fix: {fix}" in block, block
    for key in ("rollout.vllm_gpu_memory_utilization", "rollout.min_p", "algorithm.generation_batch_size"):
        assert "gpufleet has no field for it" in said[key] and "did you mean" not in said[key], said[key]
    # an option gpufleet has no field for says what gpufleet does instead
    no_field = {
        "model.disable_dropout": "sampling, the reference and the reward model run in eval mode",
        "train.optim": "AdamW (torch's, fused where the parameters allow it) is the only optimizer yet",
        "rollout.vllm_server_port": "there is no generation server to reach",
        "rollout.vllm_max_model_length": "the sampler's context is derived: rollout.max_prompt_length + ",
    }
    for key, what in no_field.items():
        block = said[key]
        assert f"`{key}` is TRL's {key.split('.')[-1]}; gpufleet has no field for it: {what}" in block, block
        assert "did you mean" not in block, block
    assert "fix: remove it; set rollout.max_prompt_length" in said["rollout.vllm_max_model_length"]
    # the wrong guesses of before are gone; a typo that is no TRL name keeps its "did you mean"
    for wrong in ("script.gradient_accumulation_steps", "env.reward_weight", "did you mean train.max_steps"):
        assert wrong not in p.stdout, p.stdout
    assert "did you mean train.learning_rate?" in said["train.learning_rat"]


def test_trl_names_from_flags_and_the_environment(tmp_path):
    (tmp_path / "job.yaml").write_text("train:\n  max_steps: 2\n")
    p = run_user(
        "check",
        "job.yaml",
        "--gpus",
        "cpu",
        "--set",
        "bf16=true",
        "--set",
        "train.use_vllm=false",
        "--set",
        "script.per_device_train_batch_size=4",
        "--set",
        "max_steps=3",
        cwd=tmp_path,
        env_extra={"GPUFLEET_OUTPUT__SAVE_STEPS": "7"},
    )
    assert p.returncode == 2, p.stdout + p.stderr
    said = _blocks(p.stdout)
    assert "fix: --set train.precision=bf16 instead" in said["bf16"]
    assert "fix: --set rollout.engine=hf instead" in said["train.use_vllm"]
    assert "fix: GPUFLEET_OUTPUT__SAVE_EVERY=7 instead" in said["output.save_steps"]
    assert "fix: --set train.max_steps=3" in said["max_steps"]  # gpufleet's name too, without its section
    # in script: (gpufleet launch's recipe) TRL's name points at the script's own field
    assert "gpufleet's is `script.per_device_batch`" in said["script.per_device_train_batch_size"]


BATCH_JOB = """\
model:
  path: builtin:tiny-qwen2
data:
  path: data.jsonl
reward:
  functions: [rewards.py:short]
algorithm:
  num_generations: 16
train:
  max_steps: 2
  per_device_train_batch_size: 4
  gradient_accumulation_steps: 4
"""


def _apply(job: str, fix: str) -> str:
    """The job with a printed `write `a: 1` and `b: 2` under `train:` instead` fix done, the TRL names gone."""
    lines = [
        line
        for line in job.splitlines()
        if not re.match(r"  (per_device_train_batch_size|gradient_acc)", line)
    ]
    fields = re.findall(r"`(\w+: \d+)`", fix.split(" under ", 1)[0])
    at = lines.index("train:") + 1
    return "\n".join(lines[:at] + [f"  {f}" for f in fields] + lines[at:]) + "\n"


def test_trl_batch_names_map_to_the_same_batch(tmp_path):
    """TRL's per_device_train_batch_size counts one forward pass; x gradient_accumulation_steps is gpufleet's
    per_device_batch (one optimizer step), TRL's value its micro_batch: the printed fix, done as printed, is a
    job check accepts with the same generation batch TRL makes (4 x 1 x 4 = 16, num_generations 16)."""
    (tmp_path / "data.jsonl").write_text("".join(f'{{"prompt": "say hi {i}"}}\n' for i in range(8)))
    (tmp_path / "rewards.py").write_text(
        "def short(completions, **kw):\n    return [-len(c) for c in completions]\n"
    )
    (tmp_path / "job.yaml").write_text(BATCH_JOB)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    said = _blocks(p.stdout)
    fix = "fix: write `per_device_batch: 16` and `micro_batch: 4` under `train:` instead"
    for key in ("train.per_device_train_batch_size", "train.gradient_accumulation_steps"):
        assert fix in said[key], said[key]
    (tmp_path / "job.yaml").write_text(_apply(BATCH_JOB, fix))
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "generation batch 16 = 16 per device x 1 policy rank x 1 step" in p.stdout, p.stdout
    assert "micro-batch 4 (4 accumulation steps)" in p.stdout, p.stdout
    # TRL's steps_per_generation counts forward passes: 8 of them with accumulation 4 are 2 optimizer steps
    flags = ["--set", "per_device_train_batch_size=2", "--set", "train.gradient_accumulation_steps=4"]
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", *flags, "--set", "train.steps_per_generation=8", cwd=tmp_path
    )
    want = "fix: --set train.per_device_batch=8 --set train.micro_batch=2 --set train.steps_per_generation=2 instead"
    assert want in _blocks(p.stdout)["per_device_train_batch_size"], p.stdout
    # not a multiple of the accumulation: refused, with the nearest whole optimizer steps
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", *flags, "--set", "train.steps_per_generation=6", cwd=tmp_path
    )
    block = _blocks(p.stdout)["train.gradient_accumulation_steps"]
    assert (
        "--set train.steps_per_generation=1 instead (steps_per_generation 1 or 2, i.e. TRL's 4 or 8: "
        in block
    )
    assert "TRL's 6 is not a multiple of gradient_accumulation_steps 4" in block, block
    # at the top level of the file, as TRL's flat config writes them
    flat = "per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\nsteps_per_generation: 4\n"
    (tmp_path / "flat.yaml").write_text(flat)
    p = run_user("check", "flat.yaml", "--gpus", "cpu", cwd=tmp_path)
    want = "fix: write `per_device_batch: 8`, `micro_batch: 4` and `steps_per_generation: 2` under `train:` instead"
    assert want in _blocks(p.stdout)["gradient_accumulation_steps"], p.stdout
    # from the environment, with TRL's default per-device batch (8)
    env = {"GPUFLEET_TRAIN__GRADIENT_ACCUMULATION_STEPS": "2"}
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path, env_extra=env)
    block = _blocks(p.stdout)["train.gradient_accumulation_steps"]
    assert "fix: GPUFLEET_TRAIN__PER_DEVICE_BATCH=16 GPUFLEET_TRAIN__MICRO_BATCH=8 instead" in block, block


def test_trl_values_get_a_fix_that_works(tmp_path):
    """TRL's values for options gpufleet spells otherwise (scale_rewards true / false, a warmup_steps fraction,
    use_vllm true) are refused with gpufleet's value in TRL's meaning, and the job with the fix done passes."""
    job = "train:\n  max_steps: 30\n  warmup_steps: 0.1\nalgorithm:\n  scale_rewards: false\n"
    (tmp_path / "job.yaml").write_text(job)
    flags = ["--set", "algorithm.scale_rewards=true", "--set", "rollout.use_vllm=true"]
    p = run_user("check", "job.yaml", "--gpus", "cpu", *flags, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    said = _blocks(p.stdout)
    warmup = said["train.warmup_steps"]
    assert (
        "TRL reads warmup_steps 0.1 as a fraction of the run (0.1 x train.max_steps 30 = 3 steps)" in warmup
    )
    assert "fix: write `warmup_steps: 3` at job.yaml:3" in warmup, warmup
    scale = [b for b in p.stdout.split("\nerror: ") if b.startswith("algorithm.scale_rewards")]
    assert "fix: --set algorithm.scale_rewards=group" in scale[0], (
        scale
    )  # the flag's true, then the file's false
    assert (
        "TRL's scale_rewards false means none" in scale[1]
        and "scale_rewards: none` at job.yaml:5" in scale[1]
    )
    vllm = said["rollout.use_vllm"]
    assert "fix: remove it: vLLM is not available yet; gpufleet samples with its own batched decoder" in vllm
    assert "engine=vllm" not in vllm and "engine: vllm" not in p.stdout, vllm
    (tmp_path / "job.yaml").write_text(job.replace("0.1", "3").replace("false", "none"))
    p = run_user("check", "job.yaml", "--gpus", "cpu", "--set", "algorithm.scale_rewards=group", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    for value in ("nan", "inf"):  # no TRL meaning: the field's own one-line error, not a traceback
        p = run_user(
            "check", "job.yaml", "--gpus", "cpu", "--set", f"train.warmup_steps={value}", cwd=tmp_path
        )
        assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
        assert "fix: use a whole number" in p.stdout, p.stdout


def test_trl_model_config_names(tmp_path):
    """TRL's ModelConfig names under model: point at gpufleet's field with the value, or say what gpufleet does
    instead; never a "did you mean" that names an unrelated field (train.torch_compile, train.precision)."""
    job = (
        "model:\n  model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\n  torch_dtype: bfloat16\n"
        "  model_revision: v1.0\n  lora_modules_to_save: [lm_head]\n  attn_implementation: sdpa\n"
    )
    (tmp_path / "job.yaml").write_text(job)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    said = _blocks(p.stdout)
    assert (
        "fix: write `path: Qwen/Qwen2.5-0.5B-Instruct` under `model:` instead"
        in said["model.model_name_or_path"]
    )
    assert "fix: write `dtype: bfloat16` under `model:` instead" in said["model.torch_dtype"]
    assert "hf download ID --revision REV --local-dir DIR" in said["model.model_revision"]
    keep = said["model.lora_modules_to_save"]
    assert (
        "gpufleet has no field for it: only the LoRA adapters train" in keep and "fix: remove it" in keep
    ), keep
    assert "did you mean" not in p.stdout and "torch_compile" not in p.stdout, p.stdout
    assert "train.precision" not in p.stdout and "lora_target_modules?" not in p.stdout, p.stdout


def test_fields_without_effect_are_warned_about(tmp_path):
    job = "train:\n  max_steps: 2\nenv:\n  reward_weight: 0.5\nscript:\n  per_device_batch: 4\n"
    (tmp_path / "job.yaml").write_text(job)
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr  # warnings, not errors
    said = _blocks(p.stdout)
    env = said["env.reward_weight"]
    assert env.startswith("warning: env.reward_weight: env.reward_weight = 0.5 (job.yaml:4)"), env
    assert "has no effect in this job" in env and "env.name is unset" in env and "reward.weights" in env
    script = said["script.per_device_batch"]
    assert script.startswith("warning: ") and "has no effect in this job" in script
    assert "gpufleet launch JOB -- CMD" in script and "train.per_device_batch" in script
    assert p.stdout.strip().endswith("0 errors, 2 warnings.")
    # with an env, env.reward_weight counts; the quickstart sets neither section: no warning
    (tmp_path / "agent.yaml").write_text("env:\n  name: builtin:keys\n  reward_weight: 0.5\n")
    p = run_user("check", "agent.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert "env.reward_weight" not in p.stdout, p.stdout
    p = run_user("check", str(ROOT / "examples" / "quickstart.yaml"), "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 0 and "no effect" not in p.stdout, p.stdout


def test_a_flat_trl_steps_per_generation_is_converted_with_the_batch(tmp_path):
    """TRL's steps_per_generation (forward passes) beside its gradient_accumulation_steps is TRL's count,
    not gpufleet's of the same name: its fix is the batch's (4 passes / 2 = 2 optimizer steps), not a
    did-you-mean that would write TRL's 4 under train:."""
    (tmp_path / "job.yaml").write_text(
        "model: {path: builtin:tiny-qwen2}\ndata: {path: builtin:repeat}\ngradient_accumulation_steps: 2\n"
        "steps_per_generation: 4\nper_device_train_batch_size: 4\n"
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    fixes = [x.strip() for x in p.stdout.splitlines() if x.strip().startswith("fix:")]
    want = "fix: write `per_device_batch: 8`, `micro_batch: 4` and `steps_per_generation: 2` under `train:` instead"
    assert fixes == [want] * 3, p.stdout
