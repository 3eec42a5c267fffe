"""Rules of chat episodes and tools (env.format: chat, rollout.tools): the tools import and transformers
can describe them, the model's chat template renders a two-turn conversation (with a tool call when there
are tools) and preserves its prefix, so that the tokens between turns can be spliced (rl/chat.py).
The tokenizer is read from the model folder (a built-in model's is made in memory); no torch import."""

from __future__ import annotations

from gpufleet import usercode
from gpufleet.errors import UserError
from gpufleet.rules.registry import Context, err, rule, warn

TOOL_FIELDS = ("rollout.max_tool_calling_iterations", "rollout.tool_timeout", "rollout.chat_template_kwargs")


@rule
def tools_need_chat_episodes(ctx: Context):
    job = ctx.job
    chat = bool(job.env.name) and job.env.format == "chat"
    if job.rollout.tools and not chat:
        how = (
            "--set env.format=chat"
            if job.env.name
            else "set env.name (e.g. builtin:keys) and env.format: chat"
        )
        yield err(
            [ctx.ref("rollout.tools"), ctx.ref("env.format")],
            "rollout.tools are offered to the policy in chat episodes only (env.format: chat with an env).",
            how,
        )
    if not chat:
        for path in TOOL_FIELDS:
            if path in ctx.r.set_fields("rollout"):
                yield warn([ctx.ref(path)], f"{path} is only read in chat episodes (env.format: chat).", "")


@rule
def chat_template_fits(ctx: Context):
    job = ctx.job
    if not job.env.name or job.env.format != "chat":
        return
    from gpufleet.rl.chat import ChatFormat, template_problem
    from gpufleet.rl.chatturns import FIX
    from gpufleet.rl.tools import load_tools

    try:
        tools = load_tools(job.rollout.tools or [], usercode.roots(ctx.r.job_path))
    except UserError as e:
        yield err([ctx.ref("rollout.tools")], getattr(e, "why", None) or e.message, e.fix)
        return
    tok = _tokenizer(job.model.path)
    if tok is None:  # a model not on this machine: the model rules say so
        return
    schemas = [t.schema for t in tools]
    try:  # a TRL environment class offers its methods (rl/trlenv.py; its own rules say what is wrong)
        from gpufleet.rl import trlenv

        envs = trlenv.env_classes(job.env.name, usercode.roots(ctx.r.job_path))
        schemas = trlenv.TrlRun(trlenv.schemas(job.env.name, envs)).offered if envs else schemas
    except UserError:
        return
    why = template_problem(tok, schemas, dict(job.rollout.chat_template_kwargs))
    if why is not None:
        yield err(
            [ctx.ref("env.format"), ctx.ref("model.path")] + ([ctx.ref("rollout.tools")] if tools else []),
            f"env.format chat: {job.model.path}'s chat template cannot lay out episodes: {why}.",
            FIX,
        )
        return
    frame = len(ChatFormat(tok, schemas, dict(job.rollout.chat_template_kwargs)).first_prompt(""))
    if frame >= job.rollout.max_prompt_length:
        yield err(
            [ctx.ref("rollout.max_prompt_length"), ctx.ref("env.format")]
            + ([ctx.ref("rollout.tools")] if tools else []),
            f"the chat template's first prompt is {frame} tokens before any observation"
            + (" (the tools it offers included)" if schemas else "")
            + f", and rollout.max_prompt_length {job.rollout.max_prompt_length} keeps only the last ones:"
            " the start of the prompt would be cut.",
            f"--set rollout.max_prompt_length={frame + 256} (the frame + the first observation's tokens)",
        )


def _tokenizer(path: str):
    from gpufleet.models.builtin import char_tokenizer, is_builtin

    if is_builtin(path):
        return char_tokenizer()
    from gpufleet.models.load import load_tokenizer

    try:
        return load_tokenizer(path)
    except UserError:
        return None
