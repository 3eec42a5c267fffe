"""Tools on a plain dataset: TRL 1.16's `GRPOTrainer(tools=[...])` without an environment_factory.

    data: {path: tasks.jsonl}            # a prompt column (chat messages, or text), other columns
    rollout: {tools: [my_tools:search]}  # no env section
    reward: {functions: [my_rewards:correct]}

Each group's episodes read one data row (the seeded order of a single-turn job, rl/data.py); its prompt
-- chat messages, or text wrapped as one user message -- is rendered once by the chat template with the
tools offered and the generation prompt. Then TRL's tool loop runs as a chat episode (rl/episodes.py,
rl/chatturns.py): a turn with tool calls is answered by `tool` messages, spliced in as the template's
bridge tokens (never trained), and the policy samples again; up to rollout.max_tool_calling_iterations
such turns, and a turn without calls -- or any turn past that -- ends the episode. Everything after the
prompt is the completion, bounded as in TRL by rollout.max_completion_length: a turn samples at most what
is left of it; a tool answer past it is dropped and ends the episode, one that exactly fills it is kept
(mask 0, its messages in the completion) and ends it, as TRL's `_tool_call_loop`; an episode is truncated
when its last token is not EOS (TRL's `is_truncated`).
The reward functions score it with TRL's arguments (rl/rewards.py). No environment runs: `NoEnv` takes
its place in the episode loop. No torch import.
"""

from __future__ import annotations


def tools_on_data(job) -> bool:
    """A job whose tools run on its data set's prompts (rollout.tools, no env.name)."""
    return bool(job.rollout.tools) and not job.env.name


def episode_config(job):
    """The episode settings: env.* for an env job; for tools on a data set, TRL's budget -- the whole
    conversation after the prompt in rollout.max_completion_length, a turn per tool-calling iteration and
    one more (no limit but the budget when max_tool_calling_iterations is None)."""
    if not tools_on_data(job):
        return job.env
    ro = job.rollout
    n = ro.max_completion_length
    iterations = ro.max_tool_calling_iterations
    turns = n if iterations is None else min(iterations + 1, n)
    return job.env.model_copy(
        update={
            "max_turns": turns,
            "max_action_tokens": n,
            "max_episode_tokens": n,
            "instructions": "",
        }
    )


def rows(job):
    """The data rows that give the episodes their first prompts (rl/trlenv.py `TrlRun`: the prompt, and
    the row's other columns for the reward functions), offering the tools of rollout.tools."""
    from gpufleet.rl.data import PromptSource
    from gpufleet.rl.tools import load_tools
    from gpufleet.rl.trlenv import TrlRun

    schemas = [t.schema for t in load_tools(job.rollout.tools or [])]
    return TrlRun({None: schemas}, PromptSource(job.data, job.train.seed), job.data.prompt_field)


class NoEnv:
    """Where an environment would be: every episode starts with no observation (the data row is the
    prompt) and ends at its first turn without tool calls (the tools run in the trainer)."""

    says_success = False

    def reset(self, items: list[tuple]) -> list[tuple[str, dict]]:
        return [("", {}) for _ in items]

    def step(self, items: list[tuple[str, str]]) -> list[tuple[str, float, bool, bool, dict]]:
        return [("", 0.0, True, False, {}) for _ in items]

    def close(self, ids: list[str]) -> None:
        return None

    def shutdown(self) -> None:
        return None
