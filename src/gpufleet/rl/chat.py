"""Chat episodes in the model's own template (env.format: chat), token-in / token-out.

The first prompt is rendered once: [user(first observation)] with the tools and the generation prompt.
After that nothing already in the episode is rendered again. The policy's sampled tokens are kept as
they are; the tokens that follow them (end of turn, the user / tool message, the next generation
prompt: the "bridge") come from rendering a dummy conversation twice, as TRL 1.16's
`GRPOTrainer._get_tool_suffix_ids` does:

    prefix = render([user "dummy", assistant ""])                      trimmed after its last EOS
    full   = render([user "dummy", assistant "", *messages], add_generation_prompt=True)
    bridge = full[len(prefix):]

so an episode is  prompt + action_1 + bridge_1 + action_2 + ...  with loss on the actions only. This
holds only for a prefix-preserving template (rendering more messages never changes the rendering of the
earlier ones): `template_problem` checks that on a two-turn conversation before the run (`gpufleet check`).
No torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DUMMY_USER = {"role": "user", "content": "dummy"}


class ChatFormat:
    """One tokenizer's chat layout of episodes (see the module docstring)."""

    def __init__(self, tokenizer, tools: Sequence[dict] = (), kwargs: dict[str, Any] | None = None):
        self.tok, self.tools, self.kwargs = tokenizer, list(tools), dict(kwargs or {})

    def render(
        self, messages: list[dict], *, generation: bool = False, tools: bool | list[dict] = False
    ) -> list[int]:
        """`tools`: True offers this format's tools, a list those (a TRL environment's, per episode)."""
        offered = tools if isinstance(tools, list) else self.tools if tools else []
        return list(
            self.tok.apply_chat_template(
                messages,
                tools=offered or None,
                add_generation_prompt=generation,
                tokenize=True,
                return_dict=False,
                **self.kwargs,
            )
        )

    def first_prompt(self, text: str | list[dict], tools: list[dict] | None = None) -> list[int]:
        """The episode's prompt: the first observation as a user message (or these messages: a data row's
        chat prompt), the tools offered (this format's, or `tools`), the generation prompt."""
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        return self.render(messages, generation=True, tools=True if tools is None else tools)

    def bridge(self, messages: list[dict]) -> list[int]:
        """The tokens between an action and the next: the end of the assistant turn, `messages` (user or
        tool), the next generation prompt (TRL's `_get_tool_suffix_ids`, for user messages too)."""
        assistant: dict = {"role": "assistant", "content": ""}
        if messages and messages[0].get("role") == "tool":  # the real tool name: some templates use it
            assistant["tool_calls"] = [
                {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
            ]
        head = [DUMMY_USER, assistant]
        prefix, full = self.render(head), self.render(head + messages, generation=True)
        prefix = _trim(prefix, self.tok.eos_token_id)
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template is not prefix-preserving (gpufleet check says why)")
        return full[len(prefix) :]

    def parse(self, action: list[int], context: list[int]) -> dict:
        """The assistant message of a sampled turn, as TRL parses it (`parse_response`)."""
        return parse_response(self.tok, action, context, self.tools)


def parse_response(tok, ids: list[int], prefix: list[int], tools: Sequence[dict] = ()) -> dict:
    """The assistant message of sampled `ids` after the context `prefix` (ids), as TRL 1.16's
    `trl.chat_template_utils.parse_response`: the tokenizer's `parse_response` on the ids (special tokens
    included) with the tools' schemas casting the arguments, a trailing EOS text cut off the content, an
    empty or missing content "", tool calls checked (`_checked_calls`); a turn the template cannot parse,
    or a tokenizer without a response template, is its text (`decode(ids, skip_special_tokens=True)`)."""
    text = {"role": "assistant", "content": tok.decode(list(ids), skip_special_tokens=True)}
    if getattr(tok, "response_template", None) is None:
        return text
    try:
        parsed = tok.parse_response(list(ids), prefix=list(prefix), tools=list(tools))
        if not isinstance(parsed, dict):  # None: even the content was lost (a heavily cut turn)
            raise ValueError("parse_response returned no message")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tok.eos_token or "")
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _checked_calls(parsed["tool_calls"])
    except Exception:  # a malformed call (TRL catches ValueError / TypeError; any template error here)
        return text
    return parsed


def _checked_calls(calls) -> None:
    """TRL's `_validate_tool_calls`: every call a dict with a string name (nested under "function" or
    flat); missing or None arguments become {}; anything else is a ValueError (the turn is then text)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list or None")
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call without a name")
        if function.get("arguments") is None:
            function["arguments"] = {}


def template_problem(
    tokenizer, tools: Sequence[dict] = (), kwargs: dict[str, Any] | None = None
) -> str | None:
    """Why this tokenizer's chat template cannot run chat episodes (None: it can). Renders a two-turn
    conversation (user, assistant, user observation, assistant; with tools: a tool call and its result)
    and checks that every shorter rendering is a prefix of the longer one, and that tool calls and tool
    results survive rendering (TRL's `supports_tool_calling`)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "the tokenizer has no chat template"
    fmt = ChatFormat(tokenizer, tools, kwargs)
    call = [{"type": "function", "function": {"name": "toolnamea", "arguments": {"argkeyb": "argvalc"}}}]
    turns: list[dict] = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nreason\n</think>\n\nactionone"},
        {"role": "user", "content": "observation"},
    ]
    if tools:
        turns += [
            {"role": "assistant", "content": "", "tool_calls": call},
            {"role": "tool", "name": "toolnamea", "content": "resultd"},
        ]
    turns.append({"role": "assistant", "content": "actiontwo"})
    try:
        for n in range(2, len(turns) + 1):
            if turns[n - 1]["role"] != "assistant":
                continue
            why = _grows(fmt, fmt.render(turns[: n - 1], generation=True), fmt.render(turns[:n]), n)
            if why is None and n < len(turns):
                done = _trim(fmt.render(turns[:n]), tokenizer.eos_token_id)
                why = _grows(fmt, done, fmt.render(turns[: n + 1], generation=True), n + 1)
            if why is not None:
                return why
            if n < len(turns):
                fmt.bridge([turns[n]])
        text = tokenizer.apply_chat_template(turns, tokenize=False, tools=list(tools) or None, **fmt.kwargs)
    except ValueError as e:
        return str(e)
    except Exception as e:  # the template (jinja) refused the conversation
        return f"it cannot render a two-turn conversation: {type(e).__name__}: {e}"
    missing = [s for s in ("toolnamea", "argkeyb", "argvalc", "resultd") if tools and s not in text]
    if missing:
        return f"it drops tool calls or tool results (renders no {', '.join(missing)})"
    return NO_PARSER if tools and getattr(tokenizer, "response_template", None) is None else None


NO_PARSER = (  # template_problem's reason for tools without a response template (its fix: known_templates)
    "the tokenizer has no response_template, so tool calls cannot be parsed (parse_response); TRL 1.16 has one "
    "only for the chat templates it knows"
)


def adopt_known(tokenizer, tools: Sequence[dict] = (), kwargs: dict[str, Any] | None = None):
    """TRL 1.16's GRPOTrainer.__init__ for a chat template TRL knows (models/known_templates.py): with tools,
    a tokenizer without a response template gets TRL's (`add_response_schema`); the episodes are rendered
    with TRL's training template (a `chat_template` in the returned kwargs) where TRL would (tools, and the
    template not prefix-preserving by TRL's check) or where the original cannot run chat episodes and the
    training template can. Returns (the kwargs for ChatFormat, a note for `gpufleet check`: the family; None
    for a template TRL does not know, or a `chat_template` the user set). Mutates the tokenizer as TRL does.
    """
    from gpufleet.models import known_templates

    kwargs = dict(kwargs or {})
    fam = known_templates.family(tokenizer.chat_template)
    if fam is None or "chat_template" in kwargs:
        return kwargs, None
    attached = tools and known_templates.attach_response_template(tokenizer) is not None
    training = known_templates.training_template(fam)
    swap = training is not None and (
        (bool(tools) and not _trl_prefix_preserving(tokenizer))
        or (
            template_problem(tokenizer, tools, kwargs) is not None
            and template_problem(tokenizer, tools, {**kwargs, "chat_template": training}) is None
        )
    )
    done = ["TRL's response template attached"] if attached else []
    if swap:
        kwargs["chat_template"] = training
        done.append(f"episodes rendered with TRL's prefix-preserving {fam.training}")
    return kwargs, f"chat template: {fam.name} ({'; '.join(done) or 'known to TRL, used as it is'})"


def _trl_prefix_preserving(tok) -> bool:
    """TRL's `is_chat_template_prefix_preserving`: a dummy tool call's rendering is a prefix of the
    rendering with its tool result and the generation prompt (arguments as a JSON string where the
    template refuses a dict, as TRL retries)."""
    for arguments in ({}, "{}"):
        call = [{"type": "function", "function": {"name": "dummy", "arguments": arguments}}]
        head = [DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": call}]
        try:
            short = tok.apply_chat_template(head, tokenize=True, return_dict=False)
            long = tok.apply_chat_template(
                [*head, {"role": "tool", "name": "dummy", "content": "dummy"}],
                tokenize=True,
                return_dict=False,
                add_generation_prompt=True,
            )
        except TypeError:
            continue
        return list(long[: len(short)]) == list(short)
    return False


def _trim(ids: list[int], eos: int | None) -> list[int]:
    """`ids` cut after their last EOS (TRL's alignment of a rendered turn's end)."""
    ends = [i for i, t in enumerate(ids) if t == eos]
    return ids[: ends[-1] + 1] if ends else ids


def _grows(fmt: ChatFormat, short: list[int], long: list[int], n: int) -> str | None:
    if long[: len(short)] == short:
        return None
    diffs = (i for i, (a, b) in enumerate(zip(short, long, strict=False)) if a != b)
    at = next(diffs, min(len(short), len(long)))
    before, after = (
        fmt.tok.decode(short[max(at - 10, 0) : at + 10]),
        fmt.tok.decode(long[max(at - 10, 0) : at + 10]),
    )
    return (
        f"adding message {n} re-renders the conversation before it ({before!r} becomes {after!r}; "
        "some templates drop earlier turns' reasoning)"
    )
