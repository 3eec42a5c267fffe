"""A job started by `srun` on several nodes: the node count, this node's rank and the rendezvous come
from Slurm's variables, so one `gpufleet launch` / `gpufleet train` line runs unchanged on every node
(examples/slurm.sbatch, examples/launch/slurm-launch.sbatch). `gpufleet.config.layers.slurm_layer` turns
them into job values (source `slurm`) above the job file and below GPUFLEET_* variables and --set flags.

    launch.nnodes          SLURM_STEP_NUM_NODES
    launch.node_rank       this host's place in the step's node list (SLURMD_NODENAME), else SLURM_NODEID
    launch.rdzv_endpoint   the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, SLURM_NODELIST),
                           port $MASTER_PORT, else 29400 + SLURM_JOB_ID % 1000 (two jobs whose first host
                           is the same machine do not meet at one port)

Only inside a step (srun sets SLURM_STEP_*) with more than one node; one task per node, since gpufleet
starts each node's ranks itself. Node lists (`gpu[01-03,07]`, `a[1-2]-ib[0-1]`, `n1,n[3-4]`) are expanded
here; `scontrol show hostnames` is asked only for one this parser does not read. No torch import.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import product
from typing import Any

RDZV_PORT = 29400


@dataclass(frozen=True)
class Finding:
    """Something about the allocation a user must know (`error`: nothing was derived)."""

    severity: str
    why: str
    fix: str
    variable: str
    """The Slurm variable it is about, as `NAME=value`."""


@dataclass
class Derived:
    """Job values from Slurm: `launch.<field>` -> (value, the variables it came from)."""

    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)


def expand_hostlist(text: str) -> list[str]:
    """`gpu[01-03,07],cpu1` -> gpu01 gpu02 gpu03 gpu07 cpu1 (zero padding kept; several bracket groups in
    one name multiply out). Raises ValueError on a list it cannot read."""
    hosts: list[str] = []
    for name in _top_level_split(text.strip()):
        parts = re.split(r"(\[[^\[\]]*\])", name)
        choices = [_range_values(p[1:-1], text) if p.startswith("[") else [p] for p in parts]
        if any("[" in p or "]" in p for p in parts if not p.startswith("[")):
            raise ValueError(f"unbalanced brackets in {text!r}")
        hosts += ["".join(c) for c in product(*choices)]
    if not hosts or any(not h for h in hosts):
        raise ValueError(f"no host names in {text!r}")
    return hosts


def _top_level_split(text: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return out + [text[start:]]


def _range_values(inner: str, text: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07."""
    values = []
    for item in inner.split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{item!r} in {text!r} is not a number or a range")
        width = len(lo)
        values += [str(n).zfill(width) for n in range(int(lo), int(hi if dash else lo) + 1)]
    return values


def _scontrol_hostnames(nodelist: str) -> list[str] | None:
    """What Slurm itself says the list expands to (None: no scontrol here, or it failed)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = done.stdout.split()
    return hosts if done.returncode == 0 and hosts else None


def derive(
    env: Mapping[str, str], hostnames: Callable[[str], list[str] | None] = _scontrol_hostnames
) -> Derived:
    """The launch values of this node in a multi-node srun step (see the module docstring); nothing outside
    Slurm or on one node. `hostnames` expands a node list this module cannot read (scontrol)."""
    out = Derived()
    nodes = env.get("SLURM_STEP_NUM_NODES")
    if nodes is None:
        allocated = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
        if allocated and allocated.isdigit() and int(allocated) > 1:
            out.findings.append(
                Finding(
                    "warning",
                    f"this runs inside a {allocated}-node Slurm allocation (SLURM_NNODES={allocated}) but not in an "
                    "srun step: it uses this node only.",
                    "start it on every node: srun --ntasks-per-node=1 gpufleet ... (examples/slurm.sbatch)",
                    f"SLURM_NNODES={allocated}",
                )
            )
        return out
    if not nodes.isdigit() or int(nodes) < 2:
        return out
    tasks = env.get("SLURM_STEP_NUM_TASKS", nodes)
    if tasks != nodes:
        out.findings.append(_one_task_per_node(tasks, nodes))
        return out
    try:
        hosts, list_var = _hosts(env, hostnames)
    except ValueError as e:
        out.findings.append(
            Finding(
                "error",
                f"cannot read the Slurm node list: {e}.",
                "run inside srun, with scontrol on PATH, or give --set launch.rdzv_endpoint=<first host>:29400",
                f"SLURM_STEP_NUM_NODES={nodes}",
            )
        )
        return out
    if len(hosts) != int(nodes):
        out.findings.append(_mismatch(list_var, env[list_var], hosts, nodes))
        return out
    out.values["launch.nnodes"] = (int(nodes), f"SLURM_STEP_NUM_NODES={nodes}")
    out.values["launch.node_rank"] = _node_rank(env, hosts, list_var)
    port, port_from = _port(env)
    out.values["launch.rdzv_endpoint"] = (f"{hosts[0]}:{port}", f"first host of {list_var}, {port_from}")
    return out


def _hosts(env: Mapping[str, str], hostnames) -> tuple[list[str], str]:
    """The step's hosts in node order, and the variable they came from."""
    var = next(
        (v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)), None
    )
    if var is None:
        raise ValueError("none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set")
    try:
        return expand_hostlist(env[var]), var
    except ValueError:
        hosts = hostnames(env[var])
        if not hosts:
            raise
        return hosts, var


def _node_rank(env: Mapping[str, str], hosts: list[str], list_var: str) -> tuple[int, str]:
    name = env.get("SLURMD_NODENAME")
    if name and hosts.count(name) == 1:
        return hosts.index(name), f"SLURMD_NODENAME={name} in {list_var}"
    node = env.get("SLURM_NODEID", "0")
    return (int(node) if node.isdigit() else 0), f"SLURM_NODEID={node}"


def _port(env: Mapping[str, str]) -> tuple[int, str]:
    given = env.get("MASTER_PORT", "")
    if given.isdigit() and 1 <= int(given) <= 65535:
        return int(given), f"MASTER_PORT={given}"
    job = env.get("SLURM_JOB_ID", "")
    port = RDZV_PORT + (int(job) % 1000 if job.isdigit() else 0)
    return port, f"port {RDZV_PORT} + SLURM_JOB_ID % 1000"


def _one_task_per_node(tasks: str, nodes: str) -> Finding:
    return Finding(
        "error",
        f"srun started {tasks} tasks on {nodes} nodes (SLURM_STEP_NUM_TASKS={tasks}), but gpufleet starts each "
        "node's ranks itself (torchrun): it wants one task per node.",
        "srun --ntasks-per-node=1 gpufleet ... (and --gpus-per-node for the GPUs)",
        f"SLURM_STEP_NUM_TASKS={tasks}",
    )


def _mismatch(var: str, text: str, hosts: list[str], nodes: str) -> Finding:
    return Finding(
        "error",
        f"{var}={text} names {len(hosts)} hosts but SLURM_STEP_NUM_NODES={nodes}.",
        "run gpufleet inside srun, which sets both, or give --set launch.nnodes / node_rank / rdzv_endpoint",
        f"{var}={text}",
    )
