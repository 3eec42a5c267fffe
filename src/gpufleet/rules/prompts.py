"""The rule of a data file's prompt lengths: train keeps each prompt's last rollout.max_prompt_length tokens
(rl/batch.py `encode_prompt`), so a longer prompt loses its start without a word at run time but one
warning line. check tokenises the longest prompts it read (datafile.LONGEST, by characters; chat prompts
rendered with the model's template as train renders them; a tools-on-data job's with the tools offered,
chat.py) and says which are cut and the length that keeps them whole. Env jobs' first prompts come from
the env at run time: train warns at the first cut. `tokenizer`: the model's, read offline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpufleet import datafile
from gpufleet.errors import UserError
from gpufleet.paths import user_path
from gpufleet.rules.registry import Context, rule, warn


@rule
def prompts_fit_max_prompt_length(ctx: Context):
    job = ctx.job
    if job.env.name or job.rollout.tools:
        return  # env and tool episodes: their first prompt is checked in chat.py / warned at run time
    found = data_scan(ctx)
    if found is None:
        return
    limit = job.rollout.max_prompt_length
    if all(isinstance(x, str) and len(x.encode()) < limit for _, x in found.longest_prompts()):
        return  # a text token is at least a byte (bar a leading space marker): none can be over
    try:
        tok = tokenizer(job.model.path, ctx.env)
    except Exception:  # MemoryError from a huge config.json, say: resources.py's model rule says what it is
        return
    if tok is not None:  # None: a model that is not here, nothing to count tokens with
        yield from long_prompts(ctx, found, lambda prompt: _tokens(tok, prompt, job))


def data_scan(ctx: Context) -> datafile.Scan | None:
    """The job's data file as check reads it (None: built-in, a hub id, or a file the data rule refuses)."""
    data = ctx.job.data
    p = user_path(data.path)
    if data.path.startswith("builtin:") or not p.exists():
        return None  # the data rule says so (or a hub id: read at train time)
    try:
        return datafile.scan(p, data.prompt_field, max_rows=datafile.check_limit(p))
    except datafile.DataFileError:
        return None  # the data rule reports it


def long_prompts(ctx: Context, found: datafile.Scan, count: Callable[[Any], tuple[int, bool]]):
    """The warning when some of the longest prompts of `found` are over rollout.max_prompt_length: `count`
    gives a prompt's tokens as train feeds them and whether it has more than those (0: not countable)."""
    limit = ctx.job.rollout.max_prompt_length
    lengths = [(n, where) for where, prompt in found.longest_prompts() if (n := count(prompt))[0]]
    over = [(n, where) for n, where in lengths if n[0] > limit or n[1]]
    if not over:
        return
    (n, more), where = max(over)
    which = f"{len(over)} of the {len(lengths)} longest prompts" if len(over) > 1 else "1 prompt"
    read = "" if found.complete else f" (of the first {found.count} rows, which check read)"
    name = user_path(ctx.job.data.path).name
    yield warn(
        [ctx.ref("rollout.max_prompt_length"), ctx.ref("data.path")],
        f"{which} of {name}{read} {'are' if len(over) > 1 else 'is'} longer than rollout.max_prompt_length "
        f"{limit} tokens, the longest {'over ' if more else ''}{n} tokens ({where}): train keeps each prompt's "
        f"last {limit} tokens, the start of a longer one is cut.",
        _fix(ctx, n, more),
    )


def tokenizer(path: str, env=None):
    """The model's tokenizer, read from what is on this machine (a folder, or a hub id in the local cache),
    never downloaded (check reads only what is offline); None when it is not here or cannot be read."""
    from gpufleet.models.builtin import char_tokenizer, is_builtin
    from gpufleet.models.info import find_config_json

    if is_builtin(path):
        return char_tokenizer()
    from gpufleet.models.load import load_tokenizer

    config = find_config_json(path, env)
    if config is None:
        return None
    try:
        return load_tokenizer(str(config.parent))
    except UserError:
        return None


def _fix(ctx: Context, n: int, more: bool) -> str:
    """The prompt length that keeps the longest whole, or, past the model's positions, the most it holds."""
    positions = ctx.model.max_position_embeddings if ctx.model else None
    room = positions - ctx.job.rollout.max_completion_length if positions else None
    if room is not None and room < 1:  # the completions alone fill the model: rules/job.py refuses that
        return f"shorten those prompts (the model has {positions} positions)"
    if room is not None and n > room:
        return (
            f"shorten those prompts: the model has {positions} positions, and with rollout.max_completion_length "
            f"{ctx.job.rollout.max_completion_length} --set rollout.max_prompt_length={room} is the most it holds"
        )
    return (
        f"--set rollout.max_prompt_length={n}{' or more' if more else ''} keeps them whole (gpufleet plan shows "
        "its memory), or shorten those prompts"
    )


def _tokens(tok, prompt, job) -> tuple[int, bool]:
    """The prompt's tokens as train counts them (a chat prompt rendered with the template and
    rollout.chat_template_kwargs), of its last `datafile.prompt_chars` characters as train tokenises them,
    and whether it has more characters than those; 0 for one the template refuses (chatdata.py says so)."""
    if isinstance(prompt, list):
        if not getattr(tok, "chat_template", None):
            return 0, False  # resources.py says the model has no template
        try:
            kwargs = dict(job.rollout.chat_template_kwargs)
            prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:  # the template (jinja) refused these messages, whatever its error type
            return 0, False
    keep = datafile.prompt_chars(job.rollout.max_prompt_length)
    try:
        return len(tok.encode(prompt[-keep:], add_special_tokens=False)), len(prompt) > keep
    except Exception:  # a text the tokenizer cannot encode: train names it (rl/batch.py encode_prompt)
        return 0, False
