"""The trainer's side of a TRL environment class (env/trl.py: TRL 1.16's `environment_factory` contract).

The environment's methods are its tools: their schemas are offered by the chat template with the first
prompt (as TRL renders `self.tools`), and every policy turn goes to the environment (on a server or in
process) as its assistant message -- with its parsed tool calls while the episode has tool-calling
turns left (rollout.max_tool_calling_iterations), without them after. The environment answers the calls
with `tool` messages (spliced in as the template's bridge, mask 0) or, for a turn without calls, ends
the episode. No torch import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gpufleet.errors import UserError

FIELD = "env.name"


def env_class(name: str | None, folders: Sequence[str] | None = None) -> type | None:
    """The TRL environment class `name` points at (module:Class, file.py:Class), or None: no env, a
    built-in or Gymnasium one, or a Gymnasium-style class (it has `step`). Import errors are UserErrors."""
    from gpufleet.env.source import is_users
    from gpufleet.env.trl import is_trl_env

    if not name or not is_users(name):
        return None
    from gpufleet import usercode

    cls = usercode.import_object(
        name, folders, field=FIELD, what="environment", example="my_envs:Sokoban", form="Class"
    )
    return cls if is_trl_env(cls) else None


def schemas(name: str, cls: type) -> list[dict]:
    """The tools' JSON schemas; a method transformers cannot describe is a UserError naming it."""
    from gpufleet.env.trl import ToolSchemaError, tool_schemas

    try:
        out = tool_schemas(cls)
    except ToolSchemaError as e:
        raise UserError(
            f"env.name {name}: transformers cannot describe its tool {cls.__name__}.{e}",
            field=FIELD,
            fix=f"give {cls.__name__}.{e.name} a type hint on every parameter and a docstring with a "
            "description and an Args: line per parameter (or a leading _ if it is not a tool)",
        ) from None
    if not out:
        raise UserError(
            f"env.name {name}: {cls.__name__} has no tools (public methods but reset and get_reward).",
            field=FIELD,
            fix="give the class the methods the policy may call, as TRL's environment_factory takes it",
        )
    return out


def action(content: str, calls: list) -> str:
    """A policy turn as the environment takes it (env/trl.py `step`)."""
    from gpufleet.env.trl import message

    return message(content, calls)


def tool_messages(obs: str) -> list[dict]:
    """The `tool` messages of the environment's answer to a turn with tool calls."""
    messages = json.loads(obs)
    return [{"role": "tool", "name": str(m["name"]), "content": str(m["content"])} for m in messages]
