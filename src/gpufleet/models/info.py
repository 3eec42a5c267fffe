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

from gpufleet.paths import user_path

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
    local = user_path(path)
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


def hub_download_problem(path: str, env: Mapping[str, str] | None = None, timeout: float = 3.0) -> str | None:
    """Why a hub id that is not in the local cache cannot be downloaded now, or None (a local folder, a
    cached id, or the hub reachable). Offline mode (HF_HUB_OFFLINE) or no TCP connection to the hub's
    host within `timeout` seconds: said at once, instead of after huggingface_hub's retries (~50 s)."""
    env = os.environ if env is None else env
    if not looks_like_hub_id(path) or user_path(path).is_dir() or find_config_json(path, env):
        return None
    if env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return f"{path} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so it cannot be downloaded"
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(env.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return (
            f"{path} is not in the local Hugging Face cache and {host}:{port} cannot be reached "
            f"({e.strerror or type(e).__name__}), so it cannot be downloaded"
        )
    return None


def hub_download_fix(path: str) -> str:
    return (
        f"download it where there is network (hf download {path}) and copy the cache folder "
        "(~/.cache/huggingface/hub) here, or point model.path at a local folder save_pretrained wrote"
    )


def has_chat_template(folder: Path) -> bool:
    """Whether a model folder's tokenizer has a chat template (tokenizer_config.json's `chat_template`,
    or a chat_template.jinja / .json file beside it), read without loading anything."""
    if any((folder / n).is_file() for n in ("chat_template.jinja", "chat_template.json")):
        return True
    cfg, _ = read_json_file(folder / "tokenizer_config.json")
    return isinstance(cfg, dict) and bool(cfg.get("chat_template"))


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
    from gpufleet.models import builtin as builtin_models

    if builtin_models.is_builtin(path):
        name = builtin_models.builtin_name(path)
        if name not in builtin_models.BUILTIN_MODELS:
            return None
        return from_config(builtin_models.builtin_config(name), path)
    cfg = find_config_json(path, env)
    if cfg is None:
        return None
    raw, _ = read_json_file(cfg)  # folder_problems reports what is wrong with it
    return from_config(raw, str(cfg)) if isinstance(raw, dict) else None


# --------------------------------------------------------------------------- a local model folder

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
GENERIC_TOKENIZERS = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
"""tokenizer_class values with no built-in eos token: the eos must come from the files."""

ROUND_TRIP_PROBES = ("  a", "a  b", " a b", "a\nb", "a\n\nb", "A b", "1+2=3", "x = (y)")
"""Texts a tokenizer should give back unchanged: rewards see the decoded completion, not the ids."""


MAX_JSON_BYTES = 64 << 20
"""A model folder's JSON files (config, tokenizer) are KB to tens of MB; bigger is not one (and would
not fit in memory once parsed)."""


def read_json_file(file: Path) -> tuple[Any, str | None]:
    """(data, None), or (None, why) with the line and column of a JSON error (bounded: a file over
    MAX_JSON_BYTES or one that is not a regular file is not read)."""
    try:
        size = file.stat().st_size
        if not file.is_file() or size > MAX_JSON_BYTES:
            what = (
                f"{size / 2**20:.0f} MiB (at most {MAX_JSON_BYTES >> 20} MiB)"
                if file.is_file()
                else "not a file"
            )
            return None, f"{file} is {what}"
        return json.loads(file.read_text(encoding="utf-8")), None
    except json.JSONDecodeError as e:
        return None, f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except (RecursionError, ValueError) as e:  # nesting too deep, an integer too long
        return None, f"{file} is not readable JSON ({str(e).split(';')[0]})"
    except UnicodeDecodeError:
        return None, f"{file} is not UTF-8 text"
    except OSError as e:
        return None, f"{file} cannot be read ({e.strerror or e})"


def folder_problems(folder: Path) -> list[tuple[str, str]]:
    """(why, fix) for each file a model folder lacks or holds broken; [] for a usable folder."""
    if not (folder / "config.json").is_file():
        return [
            (
                f"{folder} is not a model folder (no config.json in it).",
                "point it at the folder save_pretrained wrote, or at a hub id like Qwen/Qwen2.5-0.5B-Instruct",
            )
        ]
    problems = []
    config, why = read_json_file(folder / "config.json")
    if why:
        problems.append((why + ".", "fix config.json (save_pretrained writes it)"))
    elif not isinstance(config, dict) or not config.get("model_type"):
        problems.append(
            (
                f"{folder / 'config.json'} has no model_type, so no architecture can be chosen.",
                'add "model_type" (e.g. "qwen2", "llama") to config.json',
            )
        )
    if not has_weights(folder):
        problems.append(
            (
                f"{folder} holds no weights ({', '.join(WEIGHT_FILES[:3])}).",
                "copy the weight files in, or save the model with save_pretrained (to plan for a hub model you do "
                "not have: name its id, with its config.json alone in the cache: hf download ID config.json)",
            )
        )
    problems.extend(_tokenizer_problems(folder))
    return problems


def has_weights(folder: Path) -> bool:
    """Whether a model folder (or a hub cache snapshot) holds weight files."""
    return any((folder / n).is_file() for n in WEIGHT_FILES) or any(folder.glob("*.safetensors"))


REWARD_MODEL_FIX = (
    "a reward model with a classification head (an *ForSequenceClassification with num_labels 1, as TRL's "
    "RewardTrainer saves), or a reward function (reward.functions) instead"
)


def reward_head_problem(raw: Mapping[str, Any], name: str) -> tuple[str, str] | None:
    """(why, fix) when the model of config.json `raw` cannot be a reward model, else None. A reward model is a
    sequence classifier with one label (loaded with AutoModelForSequenceClassification): `architectures`
    says whether it has that head (a *ForCausalLM has none: it would get a new, untrained one with
    transformers' default of 2 labels), `id2label` / `num_labels` how many labels (transformers' default
    is 2 when neither is written)."""
    archs = [a for a in raw.get("architectures") or () if isinstance(a, str)]
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        lm = any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs)
        kind = "a causal language model" if lm else "not a sequence classifier"
        why = (
            f"{name} is {archs[0]}, {kind}: it has no classification head to score with (loaded as a reward "
            "model it would get an untrained one, with transformers' default of 2 labels)."
        )
        return why, REWARD_MODEL_FIX
    labels = raw.get("id2label")
    count = len(labels) if isinstance(labels, Mapping) and labels else raw.get("num_labels", 2)
    if count != 1:
        said = (
            ""
            if "id2label" in raw or "num_labels" in raw
            else " (its config.json names none: transformers' default)"
        )
        why = f"{name} has {count} labels{said}; a reward model gives one score per text."
        return (
            why,
            "a reward model with num_labels 1 (one score), or a reward function (reward.functions) instead",
        )
    return None


def _tokenizer_problems(folder: Path) -> list[tuple[str, str]]:
    fix = "save the tokenizer into the folder (tokenizer.save_pretrained(folder))"
    if not any((folder / n).is_file() for n in TOKENIZER_FILES):
        return [(f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}).", fix)]
    problems, settings = [], {}
    for name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        if (folder / name).is_file():
            data, why = read_json_file(folder / name)
            if why:
                problems.append((why + ".", f"fix {name}, or {fix}"))
            elif name != "tokenizer.json" and isinstance(data, dict):
                settings = {**data, **settings}
            elif name == "tokenizer.json" and (why := _unloadable(folder / name)):
                problems.append((why, f"fix {name}, or {fix}"))
    if (
        not problems
        and settings.get("tokenizer_class") in GENERIC_TOKENIZERS
        and not settings.get("eos_token")
    ):
        problems.append(
            (
                f"the tokenizer in {folder} has no eos token, so no completion could ever end.",
                'set "eos_token" in its tokenizer_config.json (e.g. "</s>" or "<|endoftext|>")',
            )
        )
    return problems


def _unloadable(file: Path) -> str | None:
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        return f"{file} cannot be loaded ({(str(e).splitlines() or [type(e).__name__])[0]})."
    return None


def round_trip_note(encode, decode) -> str | None:
    """What a tokenizer changes in ROUND_TRIP_PROBES, with one example; None when it keeps them all."""
    changed = []
    for text in ROUND_TRIP_PROBES:
        try:
            back = decode(encode(text))
        except Exception as e:  # a tokenizer that cannot encode a probe: that is what is lost
            back = f"<{type(e).__name__}>"
        if back != text:
            changed.append((text, back))
    if not changed:
        return None
    text, back = changed[0]
    return (
        f"the tokenizer does not give text back exactly: {text!r} decodes as {back!r} "
        f"({len(changed)} of {len(ROUND_TRIP_PROBES)} probes change); reward functions see the decoded text."
    )


def file_round_trip_note(folder: Path) -> str | None:
    """`round_trip_note` of the folder's tokenizer.json read by the `tokenizers` library (no torch)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception:  # unreadable tokenizer.json: folder_problems reports it, transformers decides at train
        return None
    return round_trip_note(
        lambda t: tok.encode(t, add_special_tokens=False).ids,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
    )


def router_aux_coef(coef: float | None, raw: Mapping[str, Any]) -> float:
    """The weight of the router's load-balancing loss for a model config `raw` (config.json's dict), as
    TRL 1.16 takes it: `coef` (algorithm.router_aux_loss_coef) if set, else the (text) config's own
    `router_aux_loss_coef`, or 0; 0 for a model that returns no router logits (no
    `output_router_logits` in its config). A nonzero `coef` for such a model is a ValueError (TRL's too)."""
    text = raw.get("text_config") or raw
    moe = "output_router_logits" in text
    if coef and not moe:
        raise ValueError(
            f"router_aux_loss_coef {coef} is set, but the model ({text.get('model_type', '?')}) is not a "
            "Mixture-of-Experts model that returns router logits: there is no auxiliary loss to weight"
        )
    weight = float(text.get("router_aux_loss_coef") or 0.0) if coef is None else float(coef)
    return weight if moe else 0.0
