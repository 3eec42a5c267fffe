"""Real models' chat templates that TRL 1.16 knows, recognised exactly as TRL does.

Hub tokenizers (Qwen2.5-Instruct, Qwen3, Llama-3.1-Instruct, GLM-4-MoE, gpt-oss, ...) ship no transformers
`response_template`, so their tool calls cannot be parsed (`parse_response`). TRL's GRPOTrainer, given
tools, attaches one for the chat templates it ships (`trl.chat_template_utils.add_response_schema`: the
tokenizer's `chat_template` string equal to one of TRL's) and, where the template is not
prefix-preserving, renders the episodes with TRL's training variant (`get_training_chat_template`).
gpufleet does the same from the data in chat_templates/ (written from TRL 1.16 by
bench/trl_templates_equal.py --write; Apache-2.0, see chat_templates/NOTICE): each original template's
sha256 (only matching is needed), the response templates, and TRL's `*_training.jinja` files.
Nothing is downloaded; no torch import.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DATA = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    key: str  # TRL's file stem, e.g. "qwen2_5"
    name: str  # what gpufleet prints, e.g. "Qwen2.5"
    response: str | None  # the response template TRL attaches (a key of known.json's response_templates)
    training: str | None  # TRL's training template's file in chat_templates/


@cache
def _known() -> tuple[dict[str, Family], dict[str, dict]]:
    data = json.loads((DATA / "known.json").read_text(encoding="utf-8"))
    fams = {f["sha256"]: Family(f["key"], f["name"], f["response"], f["training"]) for f in data["families"]}
    return fams, data["response_templates"]


def family(chat_template) -> Family | None:
    """The family whose original template this is, byte for byte (TRL compares the strings); a template
    shipped as named variants (a dict) is its "default" one, as TRL's `get_training_chat_template` reads it."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    if not isinstance(chat_template, str):
        return None
    return _known()[0].get(hashlib.sha256(chat_template.encode("utf-8")).hexdigest())


def response_template(fam: Family) -> dict | None:
    """A fresh copy of the response template TRL's `add_response_schema` attaches for `fam` (None: TRL has
    none for it)."""
    return copy.deepcopy(_known()[1][fam.response]) if fam.response else None


def training_template(fam: Family) -> str | None:
    """TRL's prefix-preserving training variant of `fam`'s template (None: TRL ships none)."""
    return (DATA / fam.training).read_text(encoding="utf-8") if fam.training else None


def tool_families() -> list[str]:
    """The names of the families whose tool calls TRL parses (a response template with tool calls)."""
    fams, responses = _known()
    names = [f.name for f in fams.values() if f.response and "tool_calls" in responses[f.response]["fields"]]
    return list(dict.fromkeys(names))


def attach_response_template(tokenizer) -> Family | None:
    """TRL's `add_response_schema` where it applies: a tokenizer without a response template whose chat
    template TRL knows gets TRL's (returns its family); anything else is left as it is (None). Only an
    exact string, as TRL: named variants (a dict) are not matched here."""
    if getattr(tokenizer, "response_template", None) is not None:
        return None
    if not isinstance(tokenizer.chat_template, str):
        return None
    fam = family(tokenizer.chat_template)
    template = response_template(fam) if fam is not None else None
    if template is None:
        return None
    tokenizer.response_template = template
    return fam


def no_parser_fix() -> str:
    """The fix for tools with a tokenizer that has no response template and a template TRL does not know."""
    return (
        f"use a model whose chat template is one TRL 1.16 knows ({', '.join(tool_families())}; gpufleet attaches "
        "TRL's response template to it), or save a response_template with the tokenizer (transformers' "
        "response parsing: tokenizer.response_template = {...}; tokenizer.save_pretrained(model folder))"
    )
