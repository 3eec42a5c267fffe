"""The device sampler: a thread of the launcher that appends one record a second to OUTPUT/devices.jsonl.

    with DeviceSampler(out / "devices.jsonl", interval=1.0, labels={0: ("policy", 0), 1: ("policy", 1)}):
        run the ranks ...

One record: `{"t": unix time, "node": n, "host": hostname, "cpu_percent": machine %, "gpus": [...], "ranks": [...]}`.
* gpus (NVML through the hardware seam; [] on a CPU-only machine): per device in CUDA order `index`,
  `name`, `util` (%), `mem_util` (%), `mem_used` / `mem_total` (bytes), `power_w`, `temp_c` (None where
  NVML does not say) and `ranks` on it (the launcher's layout, plus any rank whose process NVML lists).
* ranks (psutil): per rank found under the launcher `rank`, `role`, `device`, `pids`, `cpu_percent`
  (of one core: 200 = two cores busy) and `rss` (bytes), each summed over the rank's process tree (a
  launched script's children count for it). A rank is a process carrying torchrun's RANK variable; an
  in-process run (`gpufleet train` with one process) is the launcher itself, rank 0.
* env_servers (psutil; only on an agent run): per environment server process under the launcher
  (`python -m gpufleet.env.server`, env/servers.py) `index`, `pid`, `cpu_percent` and `rss`. They are
  never counted in a rank's numbers: for agent RL the environment is a cost of its own.

The thread sleeps between samples (a sample reads /proc and NVML: about a millisecond), dies with the
process, and never stops the run: a failed query leaves that value None.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from gpufleet.devicestate import processes as gpu_processes
from gpufleet.devicestate import query
from gpufleet.monitor.metrics import JsonlWriter
from gpufleet.monitor.runfiles import HOST, devices_file


class RankProcesses:
    """The rank of every process under `root` (torchrun's RANK variable), with psutil handles kept
    between samples (cpu_percent measures since the previous call on the same handle)."""

    def __init__(self, root: int, in_process: bool = False):
        self.root = psutil.Process(root)
        self.in_process = in_process
        self.known: dict[int, tuple[psutil.Process, int | None]] = {}
        self.servers: dict[int, tuple[psutil.Process, int]] = {}  # pid -> (env server, its index)

    def _rank_of(self, p: psutil.Process) -> int | None:
        if p.pid not in self.known:
            try:
                raw = p.environ().get("RANK")
                young = time.time() - p.create_time() < 10  # maybe between fork and exec: ask again
                server = env_server_index(p.cmdline())
            except (psutil.Error, OSError):
                raw, young, server = None, False, None
            if server is not None:  # its own entry, never a rank's (it may inherit RANK)
                self.servers[p.pid] = (p, server)
                raw, young = None, False
            rank = int(raw) if raw and raw.isdigit() else None
            if rank is None and young:
                return None
            self.known[p.pid] = (p, rank)
        return self.known[p.pid][1]

    def by_rank(self) -> dict[int, list[psutil.Process]]:
        try:
            tree = self.root.children(recursive=True)
        except psutil.Error:
            tree = []
        out: dict[int, list[psutil.Process]] = {}
        for p in tree:
            rank = self._rank_of(p)
            if rank is not None:
                out.setdefault(rank, []).append(self.known[p.pid][0])
        if self.in_process and not out:
            out[0] = [self.known.setdefault(self.root.pid, (self.root, 0))[0]]
        alive = {p.pid for p in tree} | {self.root.pid}
        self.known = {pid: v for pid, v in self.known.items() if pid in alive}
        self.servers = {pid: v for pid, v in self.servers.items() if pid in alive}
        return out

    def env_servers(self) -> list[dict]:
        """index, pid, CPU% and RSS of every env server seen by the last `by_rank` (children included)."""
        out = []
        for pid, (p, index) in sorted(self.servers.items(), key=lambda kv: kv[1][1]):
            try:
                procs = [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
            pids, cpu, rss = rank_usage(procs)
            if pids:
                out.append({"index": index, "pid": pid, "cpu_percent": cpu, "rss": rss})
        return out


def env_server_index(cmdline: list[str]) -> int | None:
    """The index of an environment server (`-m gpufleet.env.server ... --ready-file .../server-<i>.ready`),
    None for any other process."""
    if "gpufleet.env.server" not in cmdline:
        return None
    ready = cmdline[cmdline.index("--ready-file") + 1] if "--ready-file" in cmdline[:-1] else ""
    stem = Path(ready).name.removeprefix("server-").removesuffix(".ready")
    return int(stem) if stem.isdigit() else 0


def rank_usage(procs: list[psutil.Process]) -> tuple[list[int], float, int]:
    """pids, CPU% (of one core) and resident bytes of one rank's processes, those that still live."""
    pids, cpu, rss = [], 0.0, 0
    for p in procs:
        try:
            with p.oneshot():
                cpu += p.cpu_percent(None)
                rss += p.memory_info().rss
            pids.append(p.pid)
        except psutil.Error:
            continue
    return pids, cpu, rss


def gpu_sample(nvml, handle, index: int) -> dict:
    """What NVML says about one device now (None where it does not answer)."""
    util = query(nvml.nvmlDeviceGetUtilizationRates, handle)
    mem = query(nvml.nvmlDeviceGetMemoryInfo, handle)
    power = query(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
    temp = query(nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
    name = query(nvml.nvmlDeviceGetName, handle, fallback="GPU")
    return {
        "index": index,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "util": None if util is None else int(util.gpu),
        "mem_util": None if util is None else int(util.memory),
        "mem_used": None if mem is None else int(mem.used),
        "mem_total": None if mem is None else int(mem.total),
        "power_w": None if power is None else power / 1000.0,
        "temp_c": None if temp is None else int(temp),
        "pids": [p.pid for p in gpu_processes(nvml, handle)],
    }


class DeviceSampler:
    """The sampling thread (see the module docstring). `labels`: rank -> (role, device index or None);
    `nvml`: the pynvml seam (None: load nvidia-ml-py if installed; False: CPU only)."""

    def __init__(
        self,
        path: Path,
        interval: float,
        labels: Mapping[int, tuple[str, int | None]],
        *,
        node: int = 0,
        root: int | None = None,
        in_process: bool = False,
        nvml=None,
        env: Mapping[str, str] | None = None,
    ):
        self.path, self.interval, self.labels, self.node = path, interval, dict(labels), node
        self.ranks = RankProcesses(root or os.getpid(), in_process)
        self.nvml, self.env = nvml, os.environ if env is None else env
        self.handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer: JsonlWriter | None = None

    def _open_nvml(self) -> None:
        from gpufleet.hardware import _load_nvml, visible_order

        nvml = _load_nvml() if self.nvml is None else self.nvml
        if not nvml or query(nvml.nvmlInit, fallback=False) is False:
            self.nvml = False
            return
        count = query(nvml.nvmlDeviceGetCount, fallback=0)
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [query(nvml.nvmlDeviceGetUUID, h, fallback="") for h in handles]
        order = visible_order(self.env, count, uuids)
        self.nvml, self.handles = nvml, [handles[i] for i in (range(count) if order is None else order)]

    def sample(self) -> dict:
        """One record (see the module docstring)."""
        rank_procs = self.ranks.by_rank()
        ranks = []
        for rank in sorted(set(rank_procs) | set(self.labels)):
            role, device = self.labels.get(rank, ("worker", None))
            pids, cpu, rss = rank_usage(rank_procs.get(rank, []))
            ranks.append(
                {"rank": rank, "role": role, "device": device, "pids": pids, "cpu_percent": cpu, "rss": rss}
            )
        gpus = [gpu_sample(self.nvml, h, i) for i, h in enumerate(self.handles)] if self.nvml else []
        for g in gpus:
            pids = set(g.pop("pids"))
            g["ranks"] = [r["rank"] for r in ranks if r["device"] == g["index"] or pids & set(r["pids"])]
        record = {
            "t": time.time(),
            "node": self.node,
            "host": HOST,
            "cpu_percent": psutil.cpu_percent(None),
            "gpus": gpus,
            "ranks": ranks,
        }
        servers = self.ranks.env_servers()
        if servers:
            record["env_servers"] = servers
        return record

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._writer.write(self.sample())

    def start(self) -> DeviceSampler:
        self._open_nvml()
        self._writer = JsonlWriter(self.path)
        self.sample()  # primes cpu_percent (its first call on a handle says 0)
        self._thread = threading.Thread(target=self._loop, name="gpufleet-devices", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.ranks.in_process:  # the run (this process) is over: say so, as a launcher's last sample does
            last = self.sample()
            last["ranks"] = [{**x, "pids": [], "cpu_percent": 0.0, "rss": 0} for x in last["ranks"]]
            self._writer.write(last)
        self._writer.close()
        if self.nvml:
            query(self.nvml.nvmlShutdown)

    def __enter__(self) -> DeviceSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def sampling(interval: float, out: Path, node: int, labels, *, cpu: bool, in_process: bool = False):
    """A DeviceSampler for the block (none when `monitor.device_interval` is 0)."""
    if interval <= 0:
        yield None
        return
    sampler = DeviceSampler(
        devices_file(out, node),
        interval,
        labels,
        node=node,
        in_process=in_process,
        nvml=False if cpu else None,
    )
    with sampler:
        yield sampler


def train_labels(topo, node: int, cpu: bool) -> dict[int, tuple[str, int | None]]:
    """rank -> (role, device) of a `gpufleet train` job's ranks on `node` (topology.py's layout)."""
    return {
        q.rank: (
            q.role if q.role in ("policy", "rollout") else "scorer: " + "+".join(q.roles),
            None if cpu else q.device,
        )
        for q in topo.places()
        if q.node == node
    }
