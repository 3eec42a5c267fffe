"""Reward functions for the multi-process tests (importable by torchrun workers via PYTHONPATH)."""


def length(prompts, completions, **kw):
    """A reward with spread from the first step, so gradients are never all zero."""
    return [len(c) / 10 for c in completions]


def tiny_reward_model(folder):
    """A 1-label sequence-classification model with the built-in char tokenizer, saved to `folder`."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from gpufleet.models.builtin import materialize

    src = materialize("tiny-qwen2")
    config = AutoConfig.from_pretrained(src)
    config.num_labels = 1
    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


def slow_on_rank1(prompts, completions, **kw):
    """`length`, but rank 1 takes 0.4 s longer to score (an imbalance for the monitor's warnings)."""
    import os
    import time

    if os.environ.get("RANK") == "1":
        time.sleep(0.4)
    return length(prompts, completions)


def abort_on_rank1(prompts, completions, **kw):
    """Native code crashing on rank 1 (os.abort: SIGABRT, no Python exception, no error record)."""
    import os

    if os.environ.get("RANK") == "1":
        os.abort()
    return [0.0] * len(completions)
