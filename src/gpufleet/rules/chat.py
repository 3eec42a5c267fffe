"""Rules of chat episodes and tools (env.format: chat, rollout.tools; or rollout.tools on a data set,
rl/tooldata.py): the tools import and transformers can describe them, the model's chat template renders a
two-turn conversation (with a tool call when there are tools) and preserves its prefix, so that the tokens
between turns can be spliced (rl/chat.py), and its first prompt fits rollout.max_prompt_length.
The tokenizer is read from the model folder (a built-in model's is made in memory); no torch import."""

from __future__ import annotations

from gpufleet import usercode
from gpufleet.errors import UserError
from gpufleet.rl.tooldata import tools_on_data
from gpufleet.rules.prompts import data_scan, long_prompts, tokenizer
from gpufleet.rules.registry import Context, err, rule, warn

FIX_DATA = (
    "use a model whose chat template supports tool calling, with a response template (parse_response), and "
    "renders each turn the same whatever follows it (rollout.chat_template_kwargs may switch it, e.g. "
    "{enable_thinking: false}), or remove rollout.tools"
)
TOOL_FIELDS = ("rollout.max_tool_calling_iterations", "rollout.tool_timeout", "rollout.chat_template_kwargs")


def _chat(job) -> bool:
    """Chat episodes: an env with env.format chat, or tools on a data set (TRL's tools, no environment)."""
    return (bool(job.env.name) and job.env.format == "chat") or tools_on_data(job)


@rule
def tools_need_chat_episodes(ctx: Context):
    job = ctx.job
    if job.rollout.tools and job.env.name and job.env.format != "chat":
        yield err(
            [ctx.ref("rollout.tools"), ctx.ref("env.format")],
            "rollout.tools are offered to the policy in chat episodes only (env.format: chat with an env).",
            "--set env.format=chat",
        )
    if not _chat(job):
        # a data file's chat-format prompts are rendered with chat_template_kwargs too (resources.py's
        # data_available says it when the file has none); built-in tasks' prompts are text
        data_job = not job.env.name and not job.data.path.startswith("builtin:")
        for path in TOOL_FIELDS:
            if data_job and path == "rollout.chat_template_kwargs":
                continue
            if path in ctx.r.set_fields("rollout"):
                yield warn(
                    [ctx.ref(path)],
                    f"{path} is only read in chat episodes (env.format: chat, or rollout.tools).",
                    "",
                )


@rule
def tools_on_data_episodes(ctx: Context):
    """Tools on a data set run TRL's tool loop turn by turn; what only single-turn completions have is
    refused."""
    job = ctx.job
    if not tools_on_data(job):
        return
    what = "rollout.tools on a data set run multi-turn tool episodes"
    for path, value in (("rollout.min_completion_length", job.rollout.min_completion_length),):
        if value:
            yield err(
                [ctx.ref(path), ctx.ref("rollout.tools")],
                f"{what}, where {path.split('.')[1]} is not implemented (it applies to single-turn "
                "completions).",
                f"--set {path}={0 if isinstance(value, int) and not isinstance(value, bool) else 'false'}",
            )


@rule
def chat_template_fits(ctx: Context):
    job = ctx.job
    if not _chat(job):
        return
    from gpufleet.models.known_templates import no_parser_fix
    from gpufleet.rl.chat import NO_PARSER, ChatFormat, adopt_known, template_problem
    from gpufleet.rl.chatturns import FIX
    from gpufleet.rl.tools import load_tools

    try:
        tools = load_tools(job.rollout.tools or [], usercode.roots(ctx.r.job_path))
    except UserError as e:
        yield err([ctx.ref("rollout.tools")], getattr(e, "why", None) or e.message, e.fix)
        return
    tok = tokenizer(job.model.path, ctx.env)
    if tok is None:  # a model not on this machine: the model rules say so
        return
    schemas = [t.schema for t in tools]
    try:  # a TRL environment class offers its methods (rl/trlenv.py; its own rules say what is wrong)
        from gpufleet.rl import trlenv

        envs = trlenv.env_classes(job.env.name, usercode.roots(ctx.r.job_path))
        schemas = trlenv.TrlRun(trlenv.schemas(job.env.name, envs)).offered if envs else schemas
    except UserError:
        return
    # a chat template TRL knows: its response template, its training template (as train: rl/chatturns.py)
    kwargs, note = adopt_known(tok, schemas, dict(job.rollout.chat_template_kwargs))
    if note:
        ctx.notes.append(note)
    why = template_problem(tok, schemas, kwargs)
    data = tools_on_data(job)
    if why is not None:
        yield err(
            [ctx.ref("rollout.tools" if data else "env.format"), ctx.ref("model.path")]
            + ([ctx.ref("rollout.tools")] if tools and not data else []),
            f"{'rollout.tools' if data else 'env.format chat'}: {job.model.path}'s chat template cannot lay "
            f"out {'tool calls' if data else 'episodes'}: {why}.",
            no_parser_fix() if why == NO_PARSER else FIX_DATA if data else FIX,
        )
        return
    fmt = ChatFormat(tok, schemas, kwargs)
    frame = len(fmt.first_prompt(""))
    if frame < job.rollout.max_prompt_length and data and (found := data_scan(ctx)) is not None:
        yield from long_prompts(ctx, found, lambda prompt: (_rendered(fmt, prompt), False))
    if frame >= job.rollout.max_prompt_length:
        yield err(
            [ctx.ref("rollout.max_prompt_length")]
            + ([] if data else [ctx.ref("env.format")])
            + ([ctx.ref("rollout.tools")] if tools else []),
            f"the chat template's first prompt is {frame} tokens before "
            + ("the data row's prompt" if data else "any observation")
            + (" (the tools it offers included)" if schemas else "")
            + f", and rollout.max_prompt_length {job.rollout.max_prompt_length} keeps only the last ones:"
            " the start of the prompt would be cut.",
            f"--set rollout.max_prompt_length={frame + 256} (the frame + the "
            + ("prompt's" if data else "first observation's")
            + " tokens)",
        )


def _rendered(fmt, prompt) -> int:
    """A data row's first prompt in tokens, as a tools-on-data episode starts (the tools offered); 0 for
    one the template refuses (chatdata.py's rule says so)."""
    try:
        return len(fmt.first_prompt(prompt))
    except Exception:  # the template (jinja) refused these messages, whatever its error type
        return 0


def chat_data_frame_fits(ctx: Context, first_chat: str | None):
    """Single-turn chat-format data: the chat template's frame around a prompt (an empty user message with
    the generation prompt) must fit rollout.max_prompt_length, or every prompt loses its start (prompts are
    cut from the left). Called by resources.py's data_available, which knows whether the rows are chat."""
    job = ctx.job
    if first_chat is None or job.env.name or job.rollout.tools:
        return
    tok = tokenizer(job.model.path, ctx.env)
    if tok is None or not getattr(tok, "chat_template", None):  # no template: resources.py says it
        return
    empty = [{"role": "user", "content": ""}]
    kwargs = dict(job.rollout.chat_template_kwargs)
    try:
        text = tok.apply_chat_template(empty, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception:  # a template that refuses an empty message: chatdata.py renders the real rows
        return
    frame = len(tok.encode(text, add_special_tokens=False))
    if frame >= job.rollout.max_prompt_length:
        yield err(
            [ctx.ref("rollout.max_prompt_length"), ctx.ref("data.path")],
            f"the chat template's frame around a prompt is {frame} tokens (first chat row at {first_chat}), and "
            f"rollout.max_prompt_length {job.rollout.max_prompt_length} keeps only the last ones: every "
            "prompt's start would be cut.",
            f"--set rollout.max_prompt_length={frame + 256} (the frame + the prompt's tokens)",
        )
