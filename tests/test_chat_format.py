"""The built-in tokenizer's chat format (models/chat.py): tools rendered from their schemas, tool calls
rendered and parsed back (transformers' parse_response with the saved response template), and the
prefix property that chat episodes rely on -- through a materialized model folder, as a job loads it."""

from __future__ import annotations

from transformers.utils import get_json_schema

from gpufleet.models.builtin import materialize
from gpufleet.models.load import load_tokenizer


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def _tok(tmp_path):
    return load_tokenizer(str(materialize("tiny-qwen2", tmp_path)))


CALL = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]


def test_tools_and_tool_calls_render_and_parse_back(tmp_path):
    tok = _tok(tmp_path)
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": CALL},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=[add], tokenize=False)
    assert text == "tools: add(a,b)\nU:2+3?\nA:[add a=2,b=3]<eos>T:5\nA:5<eos>"
    schema = get_json_schema(add)
    parsed = tok.parse_response("[add a=2,b=3]", prefix="U:2+3?\nA:", tools=[schema])
    assert parsed["tool_calls"] == CALL  # "2" cast to 2 by the tool's schema
    assert tok.parse_response("5", prefix="A:")["content"] == "5"
    assert "tool_calls" not in tok.parse_response("no call]", prefix="A:")


def test_template_is_prefix_preserving(tmp_path):
    tok = _tok(tmp_path)
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": CALL}]
    tail = [{"role": "tool", "name": "add", "content": "5"}]
    short = tok.apply_chat_template(head, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(head + tail, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert full[: len(short)] == short and short[-1] == tok.eos_token_id
    assert tok.decode(full[len(short) :]) == "T:5\nA:"


def test_a_cached_folder_without_the_chat_format_is_rebuilt(tmp_path):
    """A cache from before the chat format is rebuilt in place, with the same weights."""
    folder = materialize("tiny-qwen2", tmp_path)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "chat_template.jinja").unlink()
    assert materialize("tiny-qwen2", tmp_path) == folder
    assert (folder / "chat_template.jinja").is_file() and _tok(tmp_path).response_template
    assert (folder / "model.safetensors").read_bytes() == weights
