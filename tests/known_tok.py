"""A byte-level tokenizer built locally for a real model's chat template (tests/data/chat_templates/: the
original templates, copied from TRL 1.16's trl/chat_templates, Apache-2.0): every byte is a token, the
template's control tokens (<|im_start|>, <tool_call>, <|eot_id|>, ...) are added tokens, so any text
round-trips and the template renders as on the hub tokenizer, without a download. Used by
tests/test_known_templates.py and bench/trl_templates_equal.py."""

from __future__ import annotations

import re
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# the end of an assistant turn, per family (the hub tokenizers' eos_token)
EOS = {"glm4moe": "<|user|>", "gptoss": "<|return|>", "llama3": "<|eot_id|>", "gemma4": "<turn|>"}
EOS_DEFAULT = "<|im_end|>"
CONTROL = r"<[|｜][^<>\s]{1,40}?[|｜]>|<\|[a-z_]+>|<[a-z_]+\|>|</?think>|</?tool_call>|</?tool_response>"

# a tool and a call of it (the comparisons parse a sampled turn that calls it)
TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "required": ["a", "b"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": "75001"}}}


def eos_for(key: str) -> str:
    if key.startswith("deepseek_r1"):
        return "<｜end▁of▁sentence｜>"
    return next((v for k, v in EOS.items() if key.startswith(k)), EOS_DEFAULT)


def byte_tokenizer(template: str, eos: str):
    """A transformers fast tokenizer: bytes as tokens, `template` as its chat template, `eos` its EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    controls = sorted(set(re.findall(CONTROL, template)) | {eos})
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    bos = "<|begin_of_text|>" if "<|begin_of_text|>" in controls else None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        pad_token=eos,
        bos_token=bos,
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )


def fixture_tokenizer(key: str):
    """The byte tokenizer with tests/data/chat_templates/<key>.jinja."""
    text = (TEMPLATES / f"{key}.jinja").read_text(encoding="utf-8")
    return byte_tokenizer(text, eos_for(key))
