"""Run a user's command on every rank of this node (`gpufleet launch`): the program it names (as a shell
finds it), torchrun with one `rankexec` per rank, the ranks' stderr relayed to the terminal, the silence
watchdog, and OUTPUT/launch.json, the record of what was launched."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufleet.launch import recipe


@dataclass
class Program:
    argv: list[str]  # the command as the ranks run it
    path: str | None  # the program it starts (None: not found; the checks say so)
    note: str  # one line for the header


def program(argv: list[str], env: Mapping[str, str]) -> Program:
    """The command as written: a name with a slash is that file, a bare name is looked up on the ranks'
    PATH, as a shell does. A bare `python...` that is not on PATH runs gpufleet's own Python, and the note
    says so."""
    name = argv[0]
    if os.sep in name:
        return Program(list(argv), str(Path(name).resolve()), f"  program: {name}")
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found:
        return Program(list(argv), found, f"  program: {found} ({name} on PATH)")
    if name.startswith("python"):
        note = f"  program: {name} is not on PATH: the ranks run gpufleet's own Python, {sys.executable}"
        return Program([sys.executable, *argv[1:]], sys.executable, note)
    return Program(list(argv), None, f"  program: {name} (not on PATH)")


def recipe_record(s, now: recipe.Recipe) -> dict | None:
    """The recipe table as data (None when the job has none)."""
    if s.per_device_batch is None and s.learning_rate is None:
        return None

    def row(x: recipe.Recipe) -> dict:
        return {
            "devices": x.devices,
            "per_device_batch": x.per_device_batch,
            "gradient_accumulation_steps": x.grad_accum,
            "effective_batch": x.effective_batch,
            "learning_rate": x.learning_rate,
            "max_steps": x.max_steps,
        }

    return {
        "batch_rule": s.batch_rule,
        "lr_rule": s.lr_rule,
        "reference": row(recipe.reference(s)),
        "now": row(now),
    }


def record_name(la) -> str:
    return "launch.json" if la.nnodes == 1 or la.node_rank == 0 else f"launch.node{la.node_rank}.json"


def write_record(
    out: Path, jb, prog: Program, per_node: int, now: recipe.Recipe, added: dict[str, str]
) -> Path:
    """OUTPUT/launch.json (node N > 0: launch.nodeN.json): what this launch ran, written before it starts."""
    from gpufleet.fsfaults import write_text_atomic

    la = jb.launch
    data = {
        "command": prog.argv,
        "program": prog.path,
        "cwd": os.getcwd(),
        "nproc": per_node,
        "nnodes": la.nnodes,
        "node_rank": la.node_rank,
        "world_size": per_node * la.nnodes,
        "recipe": recipe_record(jb.script, now),
        "env": dict(sorted(added.items())),
        "collective_timeout": la.collective_timeout,
        "logs": str((out / "logs").resolve()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = out / record_name(la)
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
    return path


def _clear_ends(logs: Path, la, per_node: int) -> None:
    """Remove an earlier launch's records of how its ranks ended (rank<R>.exit.json / .done.json, which
    launch/scriptfail.py reads) for this node's ranks, and (node 0) for ranks past this launch's world."""
    first, world = la.node_rank * per_node, la.nnodes * per_node
    for f in (*logs.glob("rank*.exit.json"), *logs.glob("rank*.done.json")):
        rank = f.name[4:].split(".")[0]
        if rank.isdigit() and (
            first <= int(rank) < first + per_node or (la.node_rank == 0 and int(rank) >= world)
        ):
            f.unlink(missing_ok=True)


@dataclass
class Started:
    code: int  # the agent's exit code, or torchrun.STOPPED
    silence: object  # the stall watchdog (its `found` is set when it stopped the run)


def start(
    jb,
    argv: list[str],
    per_node: int,
    values: dict[str, str],
    out: Path,
    env: Mapping[str, str],
    stop_when: Callable[[], bool] | None = None,
    record: Callable[[dict[str, str]], object] | None = None,
) -> Started:
    """Run the command on every rank of this node through torchrun; `record(env gpufleet sets)` is called
    once the ranks' environment is known, before they start."""
    from gpufleet.launch.relay import relay
    from gpufleet.launch.stall import Silence
    from gpufleet.launch.torchrun import agent_argv, run_agent, worker_env

    la = jb.launch
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _clear_ends(logs, la, per_node)
    node = "" if la.nnodes == 1 else f".node{la.node_rank}"
    with (
        tempfile.TemporaryDirectory(prefix="gpufleet-launch-") as tmp,
        relay(Path(tmp) / "console") as console,
    ):
        hooks = Path(tmp) / "stacks"
        hooks.mkdir()
        target = ["-m", "gpufleet.launch.rankexec", str(logs), "--progress", jb.script.progress_regex]
        target += ["--console", str(console.fifo), "--stacks", str(hooks), "--", *argv]
        full = agent_argv(la, per_node, str(out.resolve())) + target
        child_env = {**worker_env(per_node, env), **{f"GPUFLEET_{k.upper()}": v for k, v in values.items()}}
        if record is not None:
            from gpufleet.launch.stackhook import hook_env

            added = {k: v for k, v in child_env.items() if env.get(k) != v}
            record({**added, **hook_env(hooks, child_env.get("PYTHONPATH"))})
        ranks = [la.node_rank * per_node + i for i in range(per_node)]
        silence = Silence(logs, ranks, la.collective_timeout, hooks, logs / f"stacks{node}.txt")

        def stop() -> bool:
            return silence() or (stop_when is not None and stop_when())

        with (logs / f"torchrun{node}.log").open("a", encoding="utf-8") as agent_log:
            code = run_agent(full, child_env, agent_log, stop_when=stop, on_stop=console.mute)
            return Started(code, silence)
