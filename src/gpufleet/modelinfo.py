"""What the checks and the planner need to know about a model, read from its config.json (no torch).

`model.path` may be `builtin:<name>` (config known in advance), a local folder, or a hub id, which is
looked up in the local Hugging Face cache only: `gpufleet check` never downloads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ModelInfo:
    """The few architecture numbers the rules use, plus the raw config."""

    source: str
    model_type: str
    num_attention_heads: int | None
    num_key_value_heads: int | None
    max_position_embeddings: int | None
    hidden_size: int | None
    num_hidden_layers: int | None
    vocab_size: int | None
    raw: dict[str, Any]


def looks_like_hub_id(path: str) -> bool:
    return bool(HUB_ID.match(path)) and not path.startswith((".", "/"))


def hub_cache_dirs(env: Mapping[str, str]) -> list[Path]:
    """Where huggingface_hub keeps downloaded repos (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    dirs = []
    if env.get("HF_HUB_CACHE"):
        dirs.append(Path(env["HF_HUB_CACHE"]))
    if env.get("HF_HOME"):
        dirs.append(Path(env["HF_HOME"]) / "hub")
    dirs.append(Path(env.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface" / "hub")
    return dirs


def find_config_json(path: str, env: Mapping[str, str] | None = None) -> Path | None:
    """config.json of a local folder, or of a hub id already in the local cache."""
    env = os.environ if env is None else env
    local = Path(path).expanduser()
    if local.is_dir():
        cfg = local / "config.json"
        return cfg if cfg.is_file() else None
    if looks_like_hub_id(path):
        for root in hub_cache_dirs(env):
            snaps = root / f"models--{path.replace('/', '--')}" / "snapshots"
            if snaps.is_dir():
                for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
                    if (snap / "config.json").is_file():
                        return snap / "config.json"
    return None


def text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a config.json that describes the language model (`text_config` of vision-language
    configs, else the whole config)."""
    text = raw.get("text_config")
    return text if isinstance(text, Mapping) else raw


def checkpoint_dtype(raw: Mapping[str, Any]) -> str | None:
    """The dtype the checkpoint is stored in (`dtype`, older `torch_dtype`), e.g. `bfloat16`."""
    text = text_config(raw)
    found = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return str(found).removeprefix("torch.") if found else None


def from_config(raw: dict[str, Any], source: str) -> ModelInfo:
    """Read the architecture numbers; vision-language configs keep them in `text_config`."""
    text = text_config(raw)

    def get(*names: str) -> int | None:
        for n in names:
            v = text.get(n, raw.get(n))
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    heads = get("num_attention_heads", "n_head", "num_heads")
    return ModelInfo(
        source=source,
        model_type=str(raw.get("model_type", "unknown")),
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", "multi_query_group_num") or heads,
        max_position_embeddings=get("max_position_embeddings", "n_positions", "seq_length"),
        hidden_size=get("hidden_size", "n_embd", "d_model"),
        num_hidden_layers=get("num_hidden_layers", "n_layer", "num_layers"),
        vocab_size=get("vocab_size"),
        raw=raw,
    )


def read_model_info(path: str, env: Mapping[str, str] | None = None) -> ModelInfo | None:
    """ModelInfo for `model.path`, or None when its config is not available locally."""
    from gpufleet import builtin_models

    if builtin_models.is_builtin(path):
        name = builtin_models.builtin_name(path)
        if name not in builtin_models.BUILTIN_MODELS:
            return None
        return from_config(builtin_models.builtin_config(name), path)
    cfg = find_config_json(path, env)
    if cfg is None:
        return None
    try:
        raw = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return from_config(raw, str(cfg)) if isinstance(raw, dict) else None
