"""Load a policy/reference model and its tokenizer from a folder, a hub id, or ``builtin:<name>``.

torch and transformers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.errors import UserError
from gpufleet.models.builtin import builtin_name, is_builtin, materialize
from gpufleet.models.info import file_round_trip_note, hub_download_fix, hub_download_problem, round_trip_note

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = ("float32", "bfloat16", "float16")


def resolve_model_path(path: str, field: str = "model.path") -> str:
    """``"builtin:<name>"`` -> the folder ``materialize(name)`` made; any other path is returned unchanged,
    after checking that a hub id not in the local cache can be downloaded (a UserError at once if not)."""
    if is_builtin(path):
        return str(materialize(builtin_name(path)))
    if why := hub_download_problem(str(path)):
        raise UserError(why + ".", field=field, fix=hub_download_fix(str(path)))
    return str(path)


def load_tokenizer(path: str, field: str = "model.path") -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model, with pad/eos set; a folder it cannot come from is a UserError.

    ``AutoTokenizer`` is not trusted blindly: in transformers 5.23 a folder whose config says
    ``model_type: qwen2`` gets a ``Qwen2Tokenizer`` (byte-level BPE) rebuilt from the vocab, whatever
    tokenizer.json holds, and a character-level vocab then silently loses its spaces. So a folder whose
    tokenizer.json is a WordLevel (character-level) model is loaded as exactly that file; anything else
    goes through ``AutoTokenizer``. The pad token falls back to the eos token. A tokenizer that does not
    give text back exactly is a warning, not an error (`models.info.round_trip_note`): `gpufleet check`
    reports it from tokenizer.json, and this prints it (rank 0) only when what is loaded here differs.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    resolved = resolve_model_path(path, field)
    try:
        if _tokenizer_json_model_type(resolved) == "WordLevel":
            tokenizer = PreTrainedTokenizerFast.from_pretrained(resolved)
        else:
            tokenizer = AutoTokenizer.from_pretrained(resolved)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"cannot load the tokenizer in {resolved}: {first}",
            field=field,
            fix="save the tokenizer into that folder (tokenizer.save_pretrained(folder))",
        ) from None
    if tokenizer.eos_token is None:
        raise UserError(
            f"the tokenizer in {resolved} has no eos token, so no completion could ever end.",
            field=field,
            fix='set "eos_token" in its tokenizer_config.json',
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    note = round_trip_note(
        lambda t: tokenizer.encode(t, add_special_tokens=False),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False),
    )
    if note and os.environ.get("RANK", "0") == "0" and note != file_round_trip_note(Path(resolved)):
        print(f"warning: {field}: {note} Training goes on.", file=sys.stderr, flush=True)
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
    resolved = resolve_model_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=getattr(torch, dtype))
    except (OSError, ValueError, KeyError) as e:  # missing/partial weights, unknown model_type
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"cannot load the model in {resolved}: {first}",
            field="model.path",
            fix="point model.path at a complete folder that save_pretrained wrote",
        ) from None
    return model.to(device)


def _tokenizer_json_model_type(folder: str) -> str | None:
    file = Path(folder) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8")).get("model", {}).get("type")
    except (OSError, ValueError):
        return None
