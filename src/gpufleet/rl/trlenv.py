"""The trainer's side of a TRL environment class (env/trl.py: TRL 1.16's `environment_factory` contract).

The environment's methods are its tools: their schemas are offered by the chat template with the first
prompt (as TRL renders them), and every policy turn goes to the environment (on a server or in process)
as its assistant message -- with its parsed tool calls while the episode has tool-calling turns left
(rollout.max_tool_calling_iterations), without them after. The environment answers the calls with
`tool` messages (spliced in as the template's bridge, mask 0) or, for a turn without calls, ends the
episode.

Data (TRL's train_dataset): with a data.path that is a file or a hub dataset (not a builtin: task), the
episodes of group position p read row p of the prompt stream (rl/data.py, the same order as a single-turn
job): its prompt (text, or chat messages) is the first prompt, reset()'s text appended to its last
message; the row's columns go to reset(**row) (without `environment`, which names the episode's
environment in the dict form and picks the tools offered). Without one, reset() gets no arguments and
its text is the whole prompt. No torch import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpufleet.errors import UserError

FIELD = "env.name"


def env_classes(name: str | None, folders: Sequence[str] | None = None) -> dict[str | None, type] | None:
    """{name: class} of the TRL environment(s) `name` points at ({None: Class} for one class, TRL's dict
    form's names otherwise), or None: no env, a built-in or Gymnasium one, or a Gymnasium-style class
    (it has `step`). Import errors are UserErrors."""
    from gpufleet.env.source import is_users
    from gpufleet.env.trl import classes, is_trl_env, is_trl_envs

    if not name or not is_users(name):
        return None
    from gpufleet import usercode

    obj = usercode.import_object(
        name, folders, field=FIELD, what="environment", example="my_envs:Sokoban", form="Class", dicts=True
    )
    return classes(obj) if is_trl_env(obj) or is_trl_envs(obj) else None


def schemas(name: str, envs: dict[str | None, type]) -> dict[str | None, list[dict]]:
    """Each environment's tools' JSON schemas; a method transformers cannot describe is a UserError."""
    from gpufleet.env.trl import ToolSchemaError, tool_schemas

    out = {}
    for key, cls in envs.items():
        try:
            out[key] = tool_schemas(cls)
        except ToolSchemaError as e:
            raise UserError(
                f"env.name {name}: transformers cannot describe its tool {cls.__name__}.{e}",
                field=FIELD,
                fix=f"give {cls.__name__}.{e.name} a type hint on every parameter and a docstring with a "
                "description and an Args: line per parameter (or a leading _ if it is not a tool)",
            ) from None
        if not out[key]:
            raise UserError(
                f"env.name {name}: {cls.__name__} has no tools (public methods but reset and get_reward).",
                field=FIELD,
                fix="give the class the methods the policy may call, as TRL's environment_factory takes it",
            )
    return out


def reads_data(job) -> bool:
    """Whether a TRL environment job reads data.path (a file or a hub dataset, not a builtin: task)."""
    return not job.data.path.startswith("builtin:")


@dataclass
class TrlRun:
    """A run's TRL environment(s): the tools of each, and the data rows the episodes read (if any)."""

    schemas: dict[str | None, list[dict]]
    source: Any = None  # rl/data.py PromptSource, or None: reset() takes no arguments
    prompt_field: str = "prompt"
    _rows: dict[int, dict] = field(default_factory=dict)

    @property
    def offered(self) -> list[dict]:
        """Every environment's tools (to parse a turn's calls with; each episode is offered its own)."""
        seen, out = set(), []
        for tools in self.schemas.values():
            for t in tools:
                if json.dumps(t, sort_keys=True) not in seen:
                    seen.add(json.dumps(t, sort_keys=True))
                    out.append(t)
        return out

    def row(self, pos: int) -> dict | None:
        if self.source is None:
            return None
        if pos not in self._rows:
            if len(self._rows) >= 1024:  # a generation batch's positions are what is asked for
                self._rows.clear()
            self._rows[pos] = self.source.examples(pos, 1)[0]
        return self._rows[pos]

    def options(self, pos: int) -> tuple:
        """() or (the reset options of env/trl.py,) for the episodes of group position `pos`."""
        row = self.row(pos)
        return () if row is None else (reset_options(row, multi=None not in self.schemas),)

    def tools(self, pos: int) -> list[dict]:
        """The tools offered to the episodes of `pos`: their environment's."""
        from gpufleet.env.trl import COLUMN

        if None in self.schemas:
            return self.schemas[None]
        return self.schemas.get((self.row(pos) or {}).get(COLUMN), [])

    def first(self, pos: int, text: str) -> tuple[str | list[dict], str]:
        """(the first prompt: `text` alone, or the row's prompt with `text` appended to its last message;
        its text for reward functions' `prompts`)."""
        row = self.row(pos)
        if row is None:
            return text, text
        prompt = row.get(self.prompt_field)
        if isinstance(prompt, str):
            return prompt + text, prompt + text
        messages = [dict(m) for m in prompt]
        messages[-1]["content"] = str(messages[-1].get("content") or "") + text
        return messages, messages[-1]["content"]


def reset_options(row: dict, multi: bool) -> dict:
    """env/trl.py's reset options for a data row: the row (JSON-safe) as reset's keyword arguments; with
    the dict form, its `environment` column apart (TRL does not pass it to reset)."""
    from gpufleet.env.trl import COLUMN
    from gpufleet.env.wire import jsonable

    if not multi:
        return {"row": jsonable(row)}
    return {"row": jsonable({k: v for k, v in row.items() if k != COLUMN}), COLUMN: row.get(COLUMN)}


def trl_run(job) -> TrlRun | None:
    """The job's TrlRun, or None: its env is not a TRL environment class."""
    envs = env_classes(job.env.name)
    if envs is None:
        return None
    source = None
    if reads_data(job):
        from gpufleet.rl.data import PromptSource

        source = PromptSource(job.data, job.train.seed)
    return TrlRun(schemas(job.env.name, envs), source, job.data.prompt_field)


def reward_columns(job) -> list[str]:
    """The data columns a TRL environment job's reward functions get by keyword (TRL passes the rows'
    columns but the prompt, `environment` included); [] without a data set or a TRL environment."""
    if not job.env.name or not reads_data(job) or env_classes(job.env.name) is None:
        return []
    from gpufleet.rl.data import PromptSource

    return PromptSource(job.data, job.train.seed).reward_columns()


def passes(job) -> tuple[str, ...]:
    """("environments",) when the job's reward functions get TRL's `environments`: a TRL environment
    class in this process (env.servers 0, no env.address); () otherwise."""
    in_process = job.env.servers == 0 and not job.env.address
    return ("environments",) if in_process and env_classes(job.env.name) is not None else ()


def instances(pool, ids: list[str]) -> list | None:
    """The user's environment instances of episodes `ids` (TRL's `environments` reward argument), where
    they live in this process (env.servers 0: a LocalPool, env/table.py); None on env servers."""
    table = getattr(pool, "_table", None)
    live = getattr(table, "_live", None)
    if live is None or any(eid not in live for eid in ids):
        return None
    found = [getattr(live[eid].env, "env", None) for eid in ids]  # env/trl.py TrlEnv.env: the instance
    return None if any(f is None for f in found) else found


def action(content: str, calls: list) -> str:
    """A policy turn as the environment takes it (env/trl.py `step`)."""
    from gpufleet.env.trl import message

    return message(content, calls)


def tool_messages(obs: str) -> list[dict]:
    """The `tool` messages of the environment's answer to a turn with tool calls."""
    messages = json.loads(obs)
    return [{"role": "tool", "name": str(m["name"]), "content": str(m["content"])} for m in messages]
