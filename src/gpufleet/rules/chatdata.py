"""The rule of chat-format data rows (single-turn prompts as message lists): each is rendered with the
model's chat template before anything loads, as train renders it (rl/batch.py `tokenize_prompts`); a
row the template refuses (roles that do not alternate, a system message where it takes none) stopped
train at its first batch after check had passed."""

from __future__ import annotations

from gpufleet import datafile
from gpufleet.paths import user_path
from gpufleet.rules.prompts import tokenizer
from gpufleet.rules.registry import Context, err, rule


@rule
def chat_rows_render(ctx: Context):
    job = ctx.job
    data = job.data
    if job.env.name or job.rollout.tools or data.path.startswith("builtin:"):
        return  # env jobs do not read prompts; tools on data: chat.py's rule renders their conversation
    p = user_path(data.path)
    if not p.exists():
        return  # the data rule says so (or a hub id: rendered at train time)
    try:
        found = datafile.scan(p, data.prompt_field, max_rows=datafile.check_limit(p), keep=True)
    except datafile.DataFileError:
        return  # the data rule reports it
    if found.first_chat is None:
        return
    tok = tokenizer(job.model.path, ctx.env)
    if tok is None or not getattr(tok, "chat_template", None):
        return  # a model not here, or no template: resources.py's rule says which
    kwargs = dict(job.rollout.chat_template_kwargs)
    seen: set = set()
    for index in range(len(found)):
        prompt = found[index].get(data.prompt_field)
        shape = tuple((m.get("role"), tuple(sorted(m))) for m in prompt) if isinstance(prompt, list) else None
        if shape is None or shape in seen:  # a template refuses a layout of roles, not a text: one of each
            continue
        seen.add(shape)
        try:
            tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # the template (jinja) refused these messages, whatever its error type
            yield err(
                [ctx.ref("data.prompt_field"), ctx.ref("data.path"), ctx.ref("model.path")],
                f"the chat template of {job.model.path} cannot render row {index + 1} of {data.path}: "
                f"{type(e).__name__}: {e}",
                "give that row messages the template accepts ({'role': 'user', 'content': '...'}), or a model "
                "whose template takes them",
            )
            return
