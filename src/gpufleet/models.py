"""Load a policy/reference model and its tokenizer from a folder, a hub id, or ``builtin:<name>``.

torch and transformers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.builtin_models import builtin_name, is_builtin, materialize

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ROUND_TRIP_PROBE = " a b\n1+2=3"
"""Text every loaded tokenizer must give back unchanged (leading space, inner spaces, a newline)."""

_DTYPES = ("float32", "bfloat16", "float16")


def resolve_model_path(path: str) -> str:
    """``"builtin:<name>"`` -> the folder ``materialize(name)`` made; any other path is returned unchanged."""
    return str(materialize(builtin_name(path))) if is_builtin(path) else str(path)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model, checked to round-trip ``ROUND_TRIP_PROBE``, with pad/eos set.

    ``AutoTokenizer`` is not trusted blindly: in transformers 5.23 a folder whose config says
    ``model_type: qwen2`` gets a ``Qwen2Tokenizer`` (byte-level BPE) rebuilt from the vocab, whatever
    tokenizer.json holds, and a character-level vocab then silently loses its spaces. So a folder whose
    tokenizer.json is a WordLevel (character-level) model is loaded as exactly that file; anything else
    goes through ``AutoTokenizer``. The pad token falls back to the eos token.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    resolved = resolve_model_path(path)
    if _tokenizer_json_model_type(resolved) == "WordLevel":
        tokenizer = PreTrainedTokenizerFast.from_pretrained(resolved)
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolved)

    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer at {resolved!r} has no eos token; set eos_token in its tokenizer_config.json"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    ids = tokenizer.encode(ROUND_TRIP_PROBE, add_special_tokens=False)
    back = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if back != ROUND_TRIP_PROBE:
        raise ValueError(
            f"tokenizer at {resolved!r} ({type(tokenizer).__name__}) does not round-trip text: "
            f"{ROUND_TRIP_PROBE!r} came back as {back!r}; rewards computed on decoded completions "
            "would be wrong. Check tokenizer.json / tokenizer_config.json in that folder."
        )
    return tokenizer


def load_causal_lm(path: str, *, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """``AutoModelForCausalLM`` from ``path`` (``builtin:<name>`` allowed) in ``dtype`` on ``device``.

    The mode is left as ``from_pretrained`` sets it (eval); the trainer calls ``.train()``/``.eval()``.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    # transformers 5.x: the keyword is `dtype` (`torch_dtype` is deprecated).
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=getattr(torch, dtype))
    return model.to(device)


def _tokenizer_json_model_type(folder: str) -> str | None:
    file = Path(folder) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8")).get("model", {}).get("type")
    except (OSError, ValueError):
        return None
