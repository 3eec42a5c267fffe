"""A chat episode's turn after sampling (env.format: chat; rl/episodes.py runs the loop).

Each sampled turn is parsed into an assistant message (rl/chat.py). A turn with tool calls, while the
episode has tool-calling turns left (rollout.max_tool_calling_iterations), runs its calls (rl/tools.py)
and is answered by `tool` messages; any other turn goes to the environment as the message's content,
and the observation comes back as a `user` message. Either way the answer is spliced in as the bridge
tokens the template puts between two assistant turns (mask 0): nothing already in the episode is
rendered or tokenised again. With a TRL environment class (rl/trlenv.py) the environment runs the
tool calls: every turn goes to it as its message, and a turn with calls is answered by `tool` messages.
With tools on a data set (rl/tooldata.py) no environment runs: the first turn without tool calls ends
the episode. Each episode keeps its messages (TRL's conversational `prompts` and `completions`, for the
reward functions).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from gpufleet.errors import UserError
from gpufleet.models import known_templates
from gpufleet.rl import tooldata, trlenv
from gpufleet.rl.chat import NO_PARSER, ChatFormat, adopt_known, template_problem
from gpufleet.rl.tools import Result, Tool, load_tools, run_call


@dataclass
class ChatRun:
    """What a run's chat episodes need, built once (`chat_run`)."""

    fmt: ChatFormat
    tools: dict[str, Tool]
    max_calls: int  # tool-calling turns per episode
    timeout: float  # seconds per tool call
    trl: trlenv.TrlRun | None = None  # a TRL environment class runs the tool calls (rl/trlenv.py)
    data: trlenv.TrlRun | None = None  # tools on a data set: the rows give the first prompts (rl/tooldata.py)

    @property
    def rows(self) -> trlenv.TrlRun | None:
        """Where the first prompts' data rows come from: a TRL environment's, or a data set's with tools."""
        return self.trl if self.trl is not None else self.data


def chat_run(job, tokenizer) -> ChatRun:
    """The job's chat layout and tools; a template that cannot do it is a UserError (check says it first)."""
    ro = job.rollout
    tools = load_tools(ro.tools or [])
    trl = trlenv.trl_run(job)
    offered = trl.offered if trl is not None else [t.schema for t in tools]
    # a chat template TRL knows: its response template, its training template (as check: rules/chat.py)
    kwargs, _ = adopt_known(tokenizer, offered, dict(ro.chat_template_kwargs))
    fmt = ChatFormat(tokenizer, offered, kwargs)
    why = template_problem(tokenizer, fmt.tools, fmt.kwargs)
    data = tooldata.tools_on_data(job)
    if why is not None:
        where = "rollout.tools" if data else "env.format"
        fix = known_templates.no_parser_fix() if why == NO_PARSER else FIX
        raise UserError(f"{where}: {job.model.path}'s chat template: {why}.", field=where, fix=fix)
    calls = sys.maxsize if ro.max_tool_calling_iterations is None else ro.max_tool_calling_iterations
    rows = tooldata.rows(job) if data else None
    return ChatRun(fmt, {t.name: t for t in tools}, calls, ro.tool_timeout, trl=trl, data=rows)


FIX = (
    "use a model whose chat template renders each turn the same whatever follows it (for a reasoning model, "
    "one that keeps earlier turns' thinking; rollout.chat_template_kwargs may switch it, e.g. "
    "{enable_thinking: false}), or --set env.format=text"
)


def split_turn(run: ChatRun, live: list, actions: list) -> tuple[list, list]:
    """(tool turns [(episode, ids, text, tool calls)], environment turns [(episode, ids, text, content)])."""
    calls, steps = [], []
    for e, (ids, text) in zip(live, actions, strict=True):
        message = run.fmt.parse(ids, e.prompt + e.tokens)
        e.messages.append(message)
        wanted = message.get("tool_calls") or []
        if run.trl is not None:  # a TRL environment: every turn is its step (env/trl.py), calls while allowed
            calls_left = wanted if e.tool_rounds < run.max_calls else []
            steps.append((e, ids, text, trlenv.action(str(message.get("content") or ""), calls_left)))
        elif wanted and run.tools and e.tool_rounds < run.max_calls:
            calls.append((e, ids, text, wanted))
        else:
            steps.append((e, ids, text, str(message.get("content") or "")))
    return calls, steps


def columns(run: ChatRun | None, row_pos: list[int]) -> dict[str, list]:
    """The data rows' columns but the prompt, per episode (TRL's reward keyword arguments), for tools on
    a data set or a TRL environment with a data set; {} otherwise."""
    data = run.rows if run is not None else None
    if data is None or data.source is None:
        return {}
    rows = [data.row(pos) or {} for pos in row_pos]
    names = [k for k in rows[0] if k != data.prompt_field] if rows else []
    return {k: [r.get(k) for r in rows] for k in names}


def run_tools(run: ChatRun, clock, calls: list) -> list[list[Result]]:
    """Every tool call of this turn's tool turns, in order (timed as the phase `tools`)."""
    with clock.phase("tools"):
        return [[run_call(run.tools, c, run.timeout) for c in wanted] for _, _, _, wanted in calls]


def observation_bridge(run: ChatRun, obs: str) -> list[int]:
    """The tokens after an environment turn: the observation as a user message, then the next prompt."""
    return run.fmt.bridge([{"role": "user", "content": obs}])


def tool_bridge(run: ChatRun, messages: list[dict]) -> list[int]:
    """The tokens after a tool turn: its `tool` messages, then the next generation prompt."""
    return run.fmt.bridge(messages)
