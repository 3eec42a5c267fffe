"""TRL's side of `vs_trl.py`: one `GRPOTrainer` run in this process (started by `vs_trl.py --worker trl`).

Same model folder and tokenizer as gpufleet's `builtin:tiny-qwen2`, the same prompt stream as its
`builtin:repeat` (in order), the same reward (`repeat/chars`), and TRL's fastest fair settings on CPU:
no gradient checkpointing, bf16 only with `--precision bf16`, no reporting, no checkpoints, no progress bar, 0 data-loader workers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from measure import TEMPERATURE, Preset, StepClock, add_peak, model_folder, write_result

# GRPOConfig fields printed into the run's log (what TRL really ran with).
SHOWN_SETTINGS = (
    "activation_checkpointing bf16 fp16 use_cpu loss_type scale_rewards importance_sampling_level "
    "epsilon epsilon_high beta num_generations per_device_train_batch_size generation_batch_size "
    "steps_per_generation learning_rate mask_truncated_completions "
    "max_completion_length temperature top_p top_k min_p lr_scheduler_type optim max_grad_norm "
    "num_iterations report_to logging_steps save_strategy"
).split()


def grpo_config(a: argparse.Namespace, p: Preset):
    """TRL's `GRPOConfig` at the shared settings of preset `p` (steps, lr and seed from `a`)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(a.out)),
        # the shared settings
        per_device_train_batch_size=p.batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=p.generations,
        max_completion_length=p.completion_tokens,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=p.beta,
        loss_type="grpo",
        importance_sampling_level="token",
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        mask_truncated_completions=False,  # gpufleet keeps truncated completions in the loss, so does TRL
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=a.steps,
        seed=a.seed,
        data_seed=a.seed,
        shuffle_dataset=False,  # the same prompt order as gpufleet's builtin:repeat stream
        # TRL's fastest fair settings (bf16: autocast over fp32 weights, as gpufleet's train.precision=bf16)
        activation_checkpointing=False,  # transformers 5.23's name; TRL's default (True) is under the old one
        gradient_checkpointing=False,
        bf16=a.precision == "bf16",
        fp16=False,
        use_cpu=a.device == "cpu",
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )


def recording_reward(rewards: list[float], lengths: list[float]):
    """`repeat/chars` with TRL's reward signature; appends each step's mean reward and completion length."""
    from gpufleet.tasks import builtin_reward

    chars = builtin_reward("repeat/chars")

    def repeat_chars(prompts, completions, **columns):  # TRL names the reward's metrics after it
        out = chars(prompts, completions, **columns)
        rewards.append(sum(out) / len(out))
        lengths.append(sum(len(ids) for ids in columns["completion_ids"]) / len(out))
        return out

    return repeat_chars


def callback(clock: StepClock):
    """A `TrainerCallback` that marks each step's begin and end on `clock`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.step_begin()

        def on_step_end(self, args, state, control, **kw):
            clock.step_end()

    return Clock()


def run(a: argparse.Namespace, p: Preset) -> None:
    """Train once with TRL's GRPOTrainer and write the result file `a.result` (see measure.write_result)."""
    clock = StepClock()
    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from gpufleet.models import load_tokenizer
    from gpufleet.tasks import get_task

    # The same folder gpufleet's side loads (same weights, same tokenizer).
    folder = model_folder(p)
    tokenizer = load_tokenizer(str(folder))  # not AutoTokenizer: see gpufleet.models.load_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    # The prompt stream gpufleet reads for builtin:repeat (example i of stream `seed`), in order.
    task = get_task("repeat")
    dataset = Dataset.from_list(
        [task.make_example(i, a.seed) for i in range(a.steps * p.batch // p.generations)]
    )
    rewards: list[float] = []
    lengths: list[float] = []
    config = grpo_config(a, p)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recording_reward(rewards, lengths)],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback(clock)],
    )
    settings = {k: str(getattr(config, k)) for k in SHOWN_SETTINGS}
    settings["model.is_activation_checkpointing"] = str(
        getattr(trainer.model, "is_activation_checkpointing", "n/a")
    )
    print("[vs_trl] TRL effective settings:", json.dumps(settings), flush=True)
    clock.train(trainer.train)
    write_result(
        Path(a.result),
        clock,
        clock.ends[0] - clock.begins[0],
        trainer="trl",
        seed=a.seed,
        settings=settings,
        threads=torch.get_num_threads(),
        inner_step_time=[e - b for b, e in zip(clock.begins, clock.ends, strict=True)],
        reward=rewards,
        completion_length=lengths,
    )
    add_peak(Path(a.result), p, a.threads, a.device, a.precision)
