"""What a plan says: the bytes of each process, of each device, and the `Plan` that checks itself.

    plan.fits, plan.comfortable, plan.tightest, plan.devices[0].total, plan.to_dict()

Per node (GPU plans): the host RAM its processes need (`HostLoad`: offloaded training state or the
loading peak, plan/host.py), refused when it cannot hold that.
Per process:  total = weights + optimizer + other + the largest of train, rollout, scoring and optimizer
step, each its working memory plus the gradients it holds (the phases of one RL step follow each other
and free their working memory; the gradients are made in train and freed after the optimizer step, so
rollout and scoring run without them, DDP's buckets excepted: `ProcessLoad.freed`). Processes on one device
add up. A plan *fits* when every device's total is at most its memory, and is *comfortable* with at
least `HEADROOM` (10%) free on every device (allocator fragmentation, CUDA graphs, kernels' workspaces).
How the bytes are counted: `build.py`; which layout is chosen: `search.py`. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpufleet.hardware import Hardware
from gpufleet.plan.change import Changes
from gpufleet.plan.memory import Precision
from gpufleet.plan.shape import Models
from gpufleet.topology import Topology

HEADROOM = 0.10
"""Fraction of every device's memory a comfortable plan leaves free."""


class PlanError(ValueError):
    """A plan whose numbers do not add up (a bug in the planner, not in the job)."""


@dataclass
class ProcessLoad:
    """Predicted bytes of one process (a policy rank or a scorer rank)."""

    role: str
    weights: int
    grads: int
    optimizer: int
    other: int
    phases: dict[str, int]
    """Working memory of each phase; only the largest, with the gradients it holds, counts in `total`."""
    detail: dict[str, int] = field(default_factory=dict)
    freed: dict[str, int] = field(default_factory=dict)
    """Bytes of `grads` a phase runs without (plan/build.py `_grads_freed`); every other phase holds them."""

    def held(self, phase: str) -> int:
        """A phase's working memory and the gradients it holds."""
        return self.phases.get(phase, 0) + self.grads - self.freed.get(phase, 0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.held) if self.phases else "-"

    @property
    def peak(self) -> int:
        """The largest phase with the gradients it holds."""
        return max(map(self.held, self.phases), default=self.grads)

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.other + self.peak


@dataclass
class DeviceLoad:
    """One device (or the CPU's RAM) and the processes on it."""

    label: str
    """Device id as a string (`0`), or `cpu`."""
    index: int | None
    name: str
    capacity: int
    processes: list[ProcessLoad]

    @property
    def roles(self) -> list[str]:
        return [p.role for p in self.processes]

    def _sum(self, attr: str) -> int:
        return sum(getattr(p, attr) for p in self.processes)

    @property
    def weights(self) -> int:
        return self._sum("weights")

    @property
    def grads(self) -> int:
        return self._sum("grads")

    @property
    def optimizer(self) -> int:
        return self._sum("optimizer")

    @property
    def other(self) -> int:
        return self._sum("other")

    def phase(self, name: str) -> int:
        return sum(p.phases.get(name, 0) for p in self.processes)

    def held(self, name: str) -> int:
        """Phase `name`'s working memory and the gradients it holds, over the processes."""
        return sum(p.held(name) for p in self.processes)

    @property
    def total(self) -> int:
        return self._sum("total")

    @property
    def free(self) -> int:
        return self.capacity - self.total

    @property
    def headroom(self) -> float:
        """Fraction of the memory left free (1.0 when the memory is unknown: NVML could not say)."""
        return self.free / self.capacity if self.capacity else 1.0

    @property
    def fits(self) -> bool:
        return not self.capacity or self.total <= self.capacity

    @property
    def comfortable(self) -> bool:
        return self.headroom >= HEADROOM

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.label,
            "name": self.name,
            "roles": self.roles,
            "capacity_bytes": self.capacity,
            "total_bytes": self.total,
            "headroom": round(self.headroom, 4),
            "fits": self.fits,
            "components_bytes": {
                "weights": self.weights,
                "grads": self.grads,
                "optimizer": self.optimizer,
                "activations": self.phase("train"),
                "kv_cache": self.phase("rollout"),
                "scoring": self.phase("scoring"),
                "optimizer_step": self.phase("optimizer step"),
                "other": self.other,
            },
            "processes": [
                {
                    "role": p.role,
                    "total_bytes": p.total,
                    "peak_phase": p.peak_phase,
                    "weights": p.weights,
                    "grads": p.grads,
                    "optimizer": p.optimizer,
                    "other": p.other,
                    "phases": dict(p.phases),
                    "grads_freed": dict(p.freed),
                    "detail": dict(p.detail),
                }
                for p in self.processes
            ],
        }


LOADING_WHY = "converts its model whole to the dtype it trains in on the CPU before moving or sharding it"
"""Why loading the models fills a node's host RAM (plan/host.py), in the plan's and check's messages."""


@dataclass
class HostLoad:
    """Host RAM of one node (GPU plans): the training state its policy ranks offload
    (`placement.offload`), or the peak while its processes load their models whole on the CPU
    (`plan/host.py`), whichever is larger, plus a stated overhead per process (`overhead.HOST_OVERHEAD`)."""

    capacity: int
    """Host RAM per node (hardware.py `ram_bytes`)."""
    source: str
    """`this machine`, `stated` (--gpus ...,host=) or `assumed` (hardware.HOST_RAM_PER_GPU_MEMORY)."""
    offloaded: int
    """Weights, gradients, AdamW states and the optimizer step's temporary of the node's policy ranks."""
    overhead: int
    processes: int
    checked: bool
    """The plan refuses when the host cannot hold it (else shown only)."""
    loading: int = 0
    """The node's processes' peak while they load their models (each converts its largest model whole)."""

    @property
    def total(self) -> int:
        return max(self.offloaded, self.loading) + self.overhead

    @property
    def at_load(self) -> bool:
        """The loading peak, not the offloaded state, is the larger."""
        return self.loading > self.offloaded

    def what(self) -> str:
        """What fills the host: `placement.offload` or loading the models."""
        if self.at_load:
            return f"loading the models (each process {LOADING_WHY})"
        return "what placement.offload puts there"

    def where(self) -> str:
        """Where the capacity comes from, with how to state it."""
        if self.source == "assumed":
            return "assumed: 2x the GPUs' memory; state it with --gpus SPEC,host=256GB"
        return "stated in --gpus" if self.source == "stated" else "this machine's"

    @property
    def headroom(self) -> float:
        return (self.capacity - self.total) / self.capacity if self.capacity else 1.0

    @property
    def fits(self) -> bool:
        return not self.checked or not self.capacity or self.total <= self.capacity

    @property
    def comfortable(self) -> bool:
        return not self.checked or self.headroom >= HEADROOM

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity,
            "capacity_source": self.source,
            "total_bytes": self.total,
            "offloaded_bytes": self.offloaded,
            "loading_bytes": self.loading,
            "overhead_bytes": self.overhead,
            "processes": self.processes,
            "checked": self.checked,
            "headroom": round(self.headroom, 4),
            "fits": self.fits,
        }


# ------------------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """Where every role runs and what each device holds; `check()` runs on construction."""

    hardware: Hardware
    models: Models
    topo: Topology
    strategy: str
    """`single` (one policy rank), `ddp` or `fsdp`."""
    shards: int
    checkpointing: bool
    precision: Precision
    per_device_batch: int
    micro_batch: int
    rollout_rows: int
    prompt_tokens: int
    completion_tokens: int
    reference: str
    """`none`, `colocate` or `dedicated`."""
    reward_model: str
    """`none`, `colocate`, `dedicated` or `unsized` (its config is not available)."""
    devices: list[DeviceLoad]
    why: list[str] = field(default_factory=list)
    changes: Changes = ()
    """The planner's own choices (auto placements) as changes that make them explicit."""
    host: HostLoad | None = None
    """Host RAM per node (None on a CPU plan, where the device is the host)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Every invariant of a plan, all reported at once (PlanError names each factor)."""
        bad = []
        ranks = self.topo.policy_ranks
        if not self.topo.policy_devices:
            bad.append("no policy device")
        if self.strategy == "fsdp" and self.shards != ranks:
            bad.append(f"fsdp shards {self.shards} != policy ranks {ranks}")
        if self.strategy != "fsdp" and self.shards != 1:
            bad.append(f"{self.strategy} with shards {self.shards} (a replica per rank means 1)")
        if self.strategy == "single" and ranks != 1:
            bad.append(f"strategy single with {ranks} policy ranks")
        if not 1 <= self.micro_batch <= self.per_device_batch:
            bad.append(f"micro_batch {self.micro_batch} not in 1..per_device_batch {self.per_device_batch}")
        dedicated = self.topo.dedicated_roles()
        for role, where in (("reference", self.reference), ("reward", self.reward_model)):
            if where == "dedicated" and role not in dedicated:
                bad.append(f"{role} is dedicated but no scorer device holds it")
            if where in ("colocate", "none") and role in dedicated:
                bad.append(f"{role} is {where} but scorer device(s) hold it")
        if not self.hardware.is_cpu:
            n = len(self.hardware.devices)
            for d in self.devices:
                if d.index is None or not 0 <= d.index < n:
                    bad.append(f"device {d.label} does not exist (hardware has 0..{n - 1})")
        placed = [p.role for d in self.devices for p in d.processes if p.role.startswith("policy rank")]
        if len(placed) != len(self.topo.policy_devices):
            bad.append(f"{len(placed)} policy processes for {len(self.topo.policy_devices)} policy devices")
        for d in self.devices:
            for p in d.processes:
                amounts = (
                    p.weights,
                    p.grads,
                    p.optimizer,
                    p.other,
                    *p.phases.values(),
                    *map(p.held, p.phases),
                )
                if min(amounts, default=0) < 0:
                    bad.append(f"negative bytes in {p.role} on {d.label}")
        if bad:
            raise PlanError("inconsistent plan: " + "; ".join(bad))

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices) and (self.host is None or self.host.fits)

    @property
    def comfortable(self) -> bool:
        return all(d.comfortable for d in self.devices) and (self.host is None or self.host.comfortable)

    @property
    def tightest(self) -> DeviceLoad:
        return min(self.devices, key=lambda d: d.headroom)

    def describe_strategy(self) -> str:
        parts = []
        if self.strategy == "single":
            parts.append("one policy rank (no data parallelism)")
        elif self.strategy == "ddp":
            parts.append(f"DDP over {self.topo.policy_ranks} policy ranks (a full replica each)")
        else:
            parts.append(f"FSDP2 over {self.topo.policy_ranks} policy ranks (shard degree {self.shards})")
        for role, where in (("reference", self.reference), ("reward model", self.reward_model)):
            if where == "colocate":
                parts.append(f"{role} colocated on every policy rank")
            elif where == "dedicated":
                dev = [str(d) for d, roles in self.topo.scorer_devices if role.split()[0] in roles]
                parts.append(f"{role} on dedicated scorer device {','.join(dev)}")
        parts.append("gradient checkpointing " + ("on" if self.checkpointing else "off"))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        pol = self.models.policy
        return {
            "hardware": self.hardware.describe(),
            "model": {
                "path": pol.path,
                "config_source": pol.source,
                "model_type": pol.arch.model_type,
                "parameters": pol.params.total,
            },
            "strategy": self.strategy,
            "shards": self.shards,
            "gradient_checkpointing": self.checkpointing,
            "precision": {"weights": self.precision.weights, "compute": self.precision.compute},
            "per_device_batch": self.per_device_batch,
            "micro_batch": self.micro_batch,
            "rollout_sequences_per_rank": self.rollout_rows,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reference": self.reference,
            "reward_model": self.reward_model,
            "fits": self.fits,
            "comfortable": self.comfortable,
            "headroom_required": HEADROOM,
            "devices": [d.to_dict() for d in self.devices],
            "host": self.host.to_dict() if self.host else None,
            "why": list(self.why),
            "sets": [c.flag() for c in self.changes],
            "notes": list(self.models.notes),
        }
