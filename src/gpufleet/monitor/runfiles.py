"""What a run directory holds for `gpufleet report` and `gpufleet watch`, read tolerantly (a run still
being written has a half line at the end of its files; a run without monitoring has fewer files).

Devices: each node's sampler writes its own file (`devices_file`): devices.jsonl on node 0,
devices.node<N>.jsonl on node N. Every node's file present is read (`device_files`), the records merged
in time order, each carrying its node; on a run over several nodes a device is `node1:gpu0` (a rank on a
CPU-only node `node1:rank3`), on one node `GPU 0` (`rank 3`), as `device_label` says.
"""

from __future__ import annotations

import json
import math
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpufleet.errors import UserError
from gpufleet.monitor.launched import Launched, read_launched
from gpufleet.paths import user_path

HOST = socket.gethostname()
"""This machine's name: devices records carry the host that wrote them (`still_running` asks only its own)."""


def read_jsonl(path: Path) -> list[dict]:
    """Every whole record of a JSONL file ([] when it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def devices_file(out: Path, node_rank: int) -> Path:
    """OUTPUT/devices.jsonl on node 0, devices.node<N>.jsonl on the others (nodes may share OUTPUT)."""
    return out / ("devices.jsonl" if node_rank == 0 else f"devices.node{node_rank}.jsonl")


def device_files(out: Path) -> list[tuple[int, Path]]:
    """(node, file) of every node's devices file in `out`, node 0 first."""
    found = [(0, out / "devices.jsonl")] if (out / "devices.jsonl").exists() else []
    for p in out.glob("devices.node*.jsonl"):
        m = re.fullmatch(r"devices\.node(\d+)\.jsonl", p.name)
        if m and int(m.group(1)) > 0:
            found.append((int(m.group(1)), p))
    return sorted(found)


def merge_nodes(per_node: list[tuple[int, list[dict]]]) -> list[dict]:
    """The device records of every node in time order, each with its `node` (from its file if unsaid)."""
    records = [{**rec, "node": rec.get("node", node)} for node, recs in per_node for rec in recs]
    return sorted(records, key=lambda rec: rec.get("t", 0.0))


def read_devices(out: Path) -> list[dict]:
    """Every node's device records (see the module docstring)."""
    return merge_nodes([(node, read_jsonl(path)) for node, path in device_files(out)])


def several_nodes(records: list[dict]) -> bool:
    return len({rec.get("node", 0) for rec in records}) > 1


def device_label(kind: str, index: int, node: int, multi: bool) -> str:
    """`GPU 0` / `rank 3` on one node; `node1:gpu0` / `node1:rank3` on a run over several (`kind`: GPU or rank)."""
    return f"node{node}:{kind.lower()}{index}" if multi else f"{kind} {index}"


def latest_by_node(records: list[dict]) -> list[dict]:
    """The newest record of each node, by node."""
    last: dict[int, dict] = {}
    for rec in records:
        last[rec.get("node", 0)] = rec
    return [last[n] for n in sorted(last)]


def gpu_ranks(gpu: dict, roles: dict[int, str]) -> str:
    """The ranks on one GPU of a devices record with their roles: "policy 0, reference 2"."""
    return ", ".join(f"{roles.get(k, '?')} {k}" for k in gpu.get("ranks", []))


def device_series(records: list[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """label -> [(t, busy %, bytes)] per GPU (with the roles on it), or per rank (CPU%, RSS) where a node
    has no GPUs."""
    multi = several_nodes(records)
    out: dict[str, list[tuple[float, float, float]]] = {}
    for rec in records:
        node = rec.get("node", 0)
        roles = {x["rank"]: x["role"] for x in rec.get("ranks", [])}
        if rec.get("gpus"):
            for g in rec["gpus"]:
                who = gpu_ranks(g, roles)
                label = device_label("GPU", g["index"], node, multi) + (f" ({who})" if who else "")
                out.setdefault(label, []).append((rec["t"], g.get("util") or 0, g.get("mem_used") or 0))
        else:
            for x in rec.get("ranks", []):
                if x.get("pids"):
                    label = f"{device_label('rank', x['rank'], node, multi)} ({x['role']})"
                    out.setdefault(label, []).append((rec["t"], x["cpu_percent"], x["rss"]))
    return out


def env_server_series(records: list[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """label -> [(t, CPU %, RSS bytes)] per environment server (an agent run's `env_servers`)."""
    multi = several_nodes(records)
    out: dict[str, list[tuple[float, float, float]]] = {}
    for rec in records:
        for x in rec.get("env_servers", []):
            label = f"node{rec.get('node', 0)}:env{x['index']}" if multi else f"env server {x['index']}"
            out.setdefault(label, []).append((rec["t"], x["cpu_percent"], x["rss"]))
    return out


def ended(records: list[dict]) -> bool:
    """The sampler saw the ranks run and, in its newest record of every node, no rank is alive: the
    record finds none (its last samples are of processes that exited, 0% and 0 bytes), or every pid it
    names is gone from this machine now (a one-process run samples itself, so its last record always
    names its own pid; a run killed with -9 writes no last record at all)."""
    if not any(x.get("pids") for rec in records for x in rec.get("ranks", [])):
        return False
    return not any(
        x.get("pids") and still_running(rec, x["pids"])
        for rec in latest_by_node(records)
        for x in rec.get("ranks", [])
    )


def still_running(record: dict, pids: list[int]) -> bool:
    """Whether a process of `pids` (a devices record's rank) still runs. Only this machine's processes can
    be asked: a record another host wrote (its `host`) counts as running. A pid now held by a process
    started after the record was written is another program's (the pid was reused)."""
    if record.get("host", HOST) != HOST:
        return True
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.create_time() <= record.get("t", math.inf) + 1 and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.AccessDenied:  # another user's process, or /proc mounted hidepid: it exists
            return True
        except psutil.Error:  # NoSuchProcess (gone), ZombieProcess
            continue
    return False


def peaks(records: list[dict]) -> dict[tuple[int, str, int], tuple[float, float]]:
    """(node, "gpu" or "rank", index) -> (peak busy %, peak bytes) over the samples of live processes."""
    out: dict[tuple[int, str, int], tuple[float, float]] = {}

    def keep(key, busy, used) -> None:
        old = out.get(key, (0.0, 0.0))
        out[key] = (max(old[0], busy or 0), max(old[1], used or 0))

    for rec in records:
        node, live = rec.get("node", 0), [x for x in rec.get("ranks", []) if x.get("pids")]
        for x in live:
            keep((node, "rank", x["rank"]), x["cpu_percent"], x["rss"])
        for g in rec.get("gpus", []) if live else []:
            keep((node, "gpu", g["index"]), g.get("util"), g.get("mem_used"))
    return out


@dataclass
class Run:
    """One run directory's monitoring files."""

    path: Path
    metrics: list[dict] = field(default_factory=list)
    devices: list[dict] = field(default_factory=list)
    warnings: list[dict] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    job_yaml: str = ""
    launched: Launched | None = None
    """A `gpufleet launch`ed script's files (launched.py); None for a `gpufleet train` run."""

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the run (steps that lack it are skipped)."""
        pts = [(int(m["step"]), float(m[key])) for m in self.metrics if key in m and "step" in m]
        return [s for s, _ in pts], [v for _, v in pts]

    def agent_keys(self) -> list[str]:
        """The env/* and tools/* metrics of an agent run (what the environment and the tool calls say), in
        order of appearance; a metric never finite is left out (env/success_rate of environments that
        never say whether an episode succeeded, e.g. TRL environment classes)."""
        keys: dict[str, bool] = {}
        for m in self.metrics:
            for k, v in m.items():
                if k.startswith(("env/", "tools/")):
                    keys[k] = keys.get(k, False) or _finite(v)
        return [k for k, finite in keys.items() if finite]

    @property
    def several_nodes(self) -> bool:
        """The devices files of more than one node (labels then carry the node)."""
        return several_nodes(self.devices)

    @property
    def ranks(self) -> list[int]:
        """The policy ranks whose timings the metrics carry ([0] for one process)."""
        last = self.metrics[-1] if self.metrics else {}
        found = sorted(int(k.rsplit("rank", 1)[1]) for k in last if k.startswith("step_time/rank"))
        return found or [0]


def load_run(path: str | Path) -> Run:
    """The run in `path`; a folder that holds no run is a UserError naming what is missing."""
    p = user_path(path)
    if not p.is_dir():
        raise UserError(f"{path} is not a folder.", fix="pass a run directory (the job's output.dir)")
    has_metrics = (p / "metrics.jsonl").exists()
    trained = has_metrics or (p / "job.yaml").exists()  # `gpufleet train` writes both
    launched = read_launched(p) if (p / "launch.json").exists() or not trained else None
    if not has_metrics and launched is None and not device_files(p):
        raise UserError(
            f"{path} holds no metrics.jsonl or devices.jsonl (nor a launched script's launch.json or "
            "logs/): not a gpufleet run directory (yet).",
            fix="pass the job's output.dir, e.g. runs/quickstart",
        )
    try:
        plan = json.loads((p / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        plan = {}
    try:
        job_yaml = (p / "job.yaml").read_text(encoding="utf-8")
    except OSError:
        job_yaml = ""
    return Run(
        p,
        read_jsonl(p / "metrics.jsonl"),
        read_devices(p),
        read_jsonl(p / "warnings.jsonl"),
        plan,
        job_yaml,
        launched,
    )


def finished(run: Run) -> bool:
    """A train run with its final model or all its steps; a launched script with all its samples."""
    if run.launched is not None:
        total = run.launched.total_samples
        return bool(total and run.launched.samples >= total)
    step, total = int(run.metrics[-1].get("step", 0)) if run.metrics else 0, max_steps(run)
    return (run.path / "final").exists() or (total is not None and step >= total)


def ended_early(run: Run) -> str | None:
    """How a train run whose processes are gone ended before its last step and final model ("step 2 of
    5"); None for a run that finished, still runs, or is a launched script (its ranks' exits say)."""
    if run.launched is not None or finished(run) or not ended(run.devices):
        return None
    step = int(run.metrics[-1].get("step", 0)) if run.metrics else 0
    return f"step {step} of {max_steps(run) or '?'}"


def max_steps(run: Run) -> int | None:
    """train.max_steps from the run's job.yaml, a default included (None when it cannot be read)."""
    import re

    found = re.search(r"^\s*(?:#\s*)?max_steps:\s*(\d+)", run.job_yaml, re.MULTILINE)  # train: comes first
    return int(found.group(1)) if found else None


def _finite(value) -> bool:
    """A number that is not NaN or infinite (metrics.jsonl writes NaN for a figure with nothing to count)."""
    return isinstance(value, int | float) and math.isfinite(value)
