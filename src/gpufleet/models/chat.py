"""The chat format of the built-in character tokenizer: a Jinja chat template with tools and tool calls,
and the transformers `response_template` that parses the model's turns back into messages.

Every character is one token (models/builtin.py), so the format is short and uses only ``CHAR_VOCAB``:

    tools: add(a,b) look(key)        <- only when tools are offered: name(parameter,...) each
    U:what is 2+3?                   <- a user (or environment) message, then a newline
    A:[add a=2,b=3]<eos>             <- an assistant turn: its text, its tool calls, then EOS
    T:5                              <- a tool result, then a newline
    A:5<eos>

A tool call is ``[name key=value,key=value]`` (``[name]`` with no arguments); arguments are cast with
the tool's JSON schema when the parser is given the tools (``"2"`` -> ``2`` for an integer). ``A:`` is
the generation prompt; EOS ends a turn (TRL trims a rendered prefix at its last EOS, as here). The
template is prefix-preserving: a conversation renders as the rendering of its first messages followed
by the rest, which is what lets an episode splice the tokens between turns without re-tokenising.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'tools:' }}{%- for t in tools %}"
    "{%- set f = t.function if t.function is defined else t %}"
    "{{ ' ' + f.name + '(' + ((f.parameters.properties | list) if f.parameters is defined and "
    "f.parameters.properties is defined else []) | join(',') + ')' }}"
    "{%- endfor %}{{ '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ 'A:' + (m.content or '') }}"
    "{%- for c in (m.tool_calls or []) %}{%- set f = c.function if c.function is defined else c %}"
    "{{ '[' + f.name }}{%- if f.arguments %}{{ ' ' }}{%- for k, v in f.arguments.items() %}"
    "{{ k + '=' + (v | string) }}{%- if not loop.last %}{{ ',' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ ']' }}{%- endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{{ 'T:' + (m.content | string) + '\\n' }}"
    "{%- elif m.role == 'system' %}{{ m.content + '\\n' }}"
    "{%- else %}{{ 'U:' + (m.content | string) + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'A:' }}{%- endif %}"
)
"""Jinja source of the built-in tokenizer's chat template (see the module docstring)."""

RESPONSE_TEMPLATE: dict = {
    "version": 1,
    "start_anchor": "A:",
    "fields": {
        "content": {"content": "text"},
        "tool_calls": {
            "open_pattern": r"\[(?P<name>[A-Za-z0-9]+) ?",
            "close": "]",
            "content": "kv-lines",
            "content_args": {"line_sep": ",", "kv_sep": "="},
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
    "defaults": {"role": "assistant"},
}
"""transformers `response_template` (parse_response) of the built-in tokenizer's assistant turns."""
