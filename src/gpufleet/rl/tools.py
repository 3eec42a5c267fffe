"""Tools the policy calls in chat episodes (`rollout.tools`, TRL's `tools`): load, describe, run.

    rollout:
      tools: [my_tools:search, tools/calc.py:add]

Each function is looked up like a reward function (the job's folder, the working directory,
PYTHONPATH) and described by the JSON schema transformers' `get_json_schema` builds from its signature
and docstring (what the chat template offers the model). A call runs in the trainer process, on the
main thread, under `rollout.tool_timeout` (gpufleet/watchdog.py: a heartbeat while slow, `Overdue`
raised inside the function at the deadline); an async function is awaited there. Whatever goes wrong
in a call -- an unknown tool, bad arguments, an exception, the timeout -- becomes its result
`{'error': '...'}` (TRL's form) and counts as a failure; the run goes on. No torch import.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.errors import UserError
from gpufleet.usercode import tool_failure

FIELD = "rollout.tools"


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass
class Result:
    """One tool call's answer: the `tool` message it becomes, whether it failed, and its seconds."""

    message: dict
    failed: bool
    seconds: float


def load_tools(refs: Sequence[str], folders: Sequence[str] | None = None) -> list[Tool]:
    """The functions `refs` name, with their schemas; every failure is a UserError on rollout.tools."""
    from transformers.utils import get_json_schema

    from gpufleet import usercode

    tools: list[Tool] = []
    for ref in refs:
        fn = usercode.import_object(ref, folders, field=FIELD, what="tool", example="my_tools:search")
        if not callable(fn) or inspect.isclass(fn):
            raise UserError(
                f"{FIELD}: {ref} is not a function.", field=FIELD, fix="name a function (def or async def)"
            )
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' TypeError / DocstringParsingException: say which and why
            raise UserError(
                f"{FIELD}: transformers cannot describe {ref} to the model: {e}",
                field=FIELD,
                fix="give every parameter a type hint and the function a docstring with a description "
                "and an Args: line per parameter",
            ) from None
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise UserError(
                f"{FIELD}: two tools are named {name!r}.", field=FIELD, fix="give each tool its own name"
            )
        tools.append(Tool(name, fn, schema))
    return tools


def run_call(tools: dict[str, Tool], call: Any, timeout: float) -> Result:
    """Run one parsed tool call ({"type": "function", "function": {"name", "arguments"}})."""
    from gpufleet.watchdog import Overdue, deadline

    start = time.perf_counter()
    function = call.get("function", call) if isinstance(call, dict) else {}
    name = str(function.get("name", "unknown")) if isinstance(function, dict) else "unknown"
    args = function.get("arguments") if isinstance(function, dict) else None
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        if not isinstance(args, dict):
            raise TypeError(f"arguments must be a mapping, got {args!r}")
        with deadline(f"tool {name}", timeout):
            out = tools[name].fn(**args)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
        content, failed = str(out), False
    except Overdue:
        content, failed = (
            str({"error": f"{name} did not return within rollout.tool_timeout {timeout:g} s"}),
            True,
        )
    except (
        Exception,
        SystemExit,
    ) as e:  # the user's tool raised: its result says so (TRL's form), the run goes on
        content, failed = str({"error": tool_failure(name, e)}), True
    message = {"role": "tool", "name": name, "content": content}
    return Result(message, failed, time.perf_counter() - start)


async def _awaited(awaitable):
    return await awaitable
