"""Tiny built-in models for tests and the demo, made locally from a config (never downloaded).

A job names one as ``model: builtin:tiny-qwen2``. ``materialize`` turns the name into an ordinary
Hugging Face folder (config.json, model.safetensors, a character-level tokenizer) that every other part
of gpufleet loads like any model folder.

This module imports neither torch nor transformers at import time: ``gpufleet check`` reads
``BUILTIN_MODELS`` to plan memory without paying for them. ``materialize`` imports them lazily.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

from gpufleet.models.chat import CHAT_TEMPLATE, RESPONSE_TEMPLATE
from gpufleet.paths import user_path

PREFIX = "builtin:"

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1

_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?:.,;!()[]<>#'\"\n"

CHAR_VOCAB: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, *dict.fromkeys(_CHARS))
"""The fixed vocabulary: ``<pad>`` (id 0), ``<eos>`` (id 1), then one token per character."""

UNK_CHAR = "?"
"""The token a character outside ``CHAR_VOCAB`` is read as (an ordinary, sampled and scored token, unlike pad)."""

assert len(set(CHAR_VOCAB)) == len(CHAR_VOCAB) and CHAR_VOCAB.index(EOS_TOKEN) == EOS_TOKEN_ID


def _decoder_config(
    model_type: str,
    architecture: str,
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    max_position_embeddings: int = 1024,
) -> dict[str, Any]:
    """The config.json of a small Llama-family decoder over ``CHAR_VOCAB``."""
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": len(CHAR_VOCAB),
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": "float32",
    }
    if model_type == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    return config


BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": _decoder_config(
        "qwen2",
        "Qwen2ForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    ),
    "tiny-llama": _decoder_config(
        "llama",
        "LlamaForCausalLM",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    ),
    "small-qwen2": _decoder_config(
        "qwen2",
        "Qwen2ForCausalLM",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=True,
    ),
}
"""Built-in model name -> the exact config.json written by ``materialize``."""


def is_builtin(path: str) -> bool:
    """Whether a model path names a built-in model (``builtin:<name>``)."""
    return str(path).startswith(PREFIX)


def builtin_name(path: str) -> str:
    """``"builtin:tiny-qwen2"`` -> ``"tiny-qwen2"`` (a bare name is returned unchanged)."""
    path = str(path)
    return path[len(PREFIX) :] if is_builtin(path) else path


def builtin_config(name: str) -> dict[str, Any]:
    """A copy of the config.json dict of built-in model ``name`` (``builtin:`` prefix allowed)."""
    name = builtin_name(name)
    if name not in BUILTIN_MODELS:
        known = ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
        raise ValueError(f"unknown built-in model {name!r}; known: {known}")
    return json.loads(json.dumps(BUILTIN_MODELS[name]))


def default_root() -> Path:
    """Where built-in models are materialized: ``$GPUFLEET_CACHE`` or ``~/.cache/gpufleet``."""
    env = os.environ.get("GPUFLEET_CACHE")
    return user_path(env) if env else Path.home() / ".cache" / "gpufleet"


def model_dir(name: str, root: str | Path | None = None, seed: int = 0) -> Path:
    """The folder ``materialize(name, root, seed)`` creates: ``<root>/models/<name>[-seed<seed>]``."""
    name = builtin_name(name)
    builtin_config(name)  # validate the name
    folder = name if seed == 0 else f"{name}-seed{seed}"
    return user_path(root if root is not None else default_root()) / "models" / folder


def is_materialized(name: str, root: str | Path | None = None, seed: int = 0) -> bool:
    """Whether ``materialize(name, root, seed)`` would find its folder complete (and write nothing)."""
    return _is_complete(model_dir(name, root, seed), builtin_config(name))


def materialize(name: str, root: str | Path | None = None, seed: int = 0) -> Path:
    """Create (once) the Hugging Face folder of built-in model ``name`` and return its path.

    Weights are a random init seeded with ``seed``: two materializations are bitwise identical. Safe
    when several processes (e.g. torchrun ranks) call it at once: each builds in a private temporary
    folder next to the target and renames it into place; a process that loses the race keeps the
    winner's folder. A folder left by a gpufleet whose config differed is replaced.
    """
    return materialize_config(builtin_config(name), model_dir(name, root, seed), seed)


def materialize_config(config: dict[str, Any], target: Path, seed: int = 0) -> Path:
    """``materialize`` for any config.json dict over ``CHAR_VOCAB`` (the benchmarks' larger models):
    the folder ``target`` with that config, seeded random weights and the character tokenizer."""
    target = Path(target)
    if _is_complete(target, config):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _build(tmp, config, seed)
        if target.exists() and not _is_complete(target, config):
            _move_aside(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, config):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(folder: Path, config: dict[str, Any]) -> bool:
    try:
        on_disk = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    try:  # a folder from a gpufleet whose tokenizer had no unknown-character fallback is rebuilt
        unk = json.loads((folder / "tokenizer.json").read_text())["model"].get("unk_token")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    try:  # ... and one whose tokenizer had no chat format (models/chat.py)
        chat = json.loads((folder / "tokenizer_config.json").read_text()).get("response_template")
        template = (folder / "chat_template.jinja").read_text()
    except (OSError, ValueError, AttributeError):
        return False
    fresh = chat == RESPONSE_TEMPLATE and template == CHAT_TEMPLATE
    return on_disk == config and (folder / "model.safetensors").is_file() and unk == UNK_CHAR and fresh


def _move_aside(folder: Path) -> None:
    """Rename a stale folder out of the way (then delete it); another process may have done it first."""
    stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".stale", dir=folder.parent))
    try:
        os.rename(folder, stale / folder.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(stale, ignore_errors=True)


def _build(folder: Path, config: dict[str, Any], seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf_config = AutoConfig.from_pretrained(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 100 kB file
    # Every process writes its own private copy: transformers would skip the weights on torch.distributed
    # ranks other than 0, and a rank that wins the rename race would publish a folder without them.
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        model.save_pretrained(folder)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    # save_pretrained rewrites config.json with extra fields; keep the documented dict exactly.
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    char_tokenizer().save_pretrained(folder)
    # mkdtemp (and safetensors) create owner-only files; a cache folder should be readable by all.
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def char_tokenizer():
    """The character-level tokenizer over ``CHAR_VOCAB`` as a transformers fast tokenizer.

    Every character is one token (spaces and newlines included) and decoding concatenates, so
    ``decode(encode(text)) == text`` for any text over the vocabulary. A character outside it (é, an
    emoji, NUL) becomes ``UNK_CHAR``: any text trains, and the ids and vocabulary size stay as they were.
    Its chat template (tools and tool calls) and response template are models/chat.py's.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(CHAR_VOCAB)}, unk_token=UNK_CHAR))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (PAD_TOKEN, EOS_TOKEN)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tok.response_template = json.loads(json.dumps(RESPONSE_TEMPLATE))
    return tok
