"""One code path for 1 or N processes: who am I, where do I run, and the process groups per role.

RANK / WORLD_SIZE / LOCAL_RANK / GROUP_RANK are read here and nowhere else (torchrun sets them; a
plain `gpufleet train` has none and is rank 0 of 1). Every node has the same layout: local ranks
0..P-1 are policy ranks (one per policy device), the next ones are scorer ranks (reference / reward
models on dedicated devices), then the rollout ranks (rl/rollouts.py). The backend is NCCL on GPUs and gloo on the CPU.

Collective timeout: `launch.collective_timeout` seconds (default 600) for every process group. A
rank that dies does not wait for it: torchrun stops the other workers (SIGTERM, then SIGKILL after
30 s) as soon as it sees a worker exit non-zero.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from gpufleet.monitor.timing import PhaseClock
from gpufleet.topology import Topology


@dataclass
class Runtime:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    role: str = "policy"  # "policy", "scorer" or "rollout"
    roles: tuple[str, ...] = ()  # for a scorer: the models it holds ("reference", "reward")
    policy_ranks: list[int] = field(default_factory=lambda: [0])
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    policy_group: object | None = None
    scorers: list[tuple[int, tuple[str, ...], object]] = field(default_factory=list)
    """(scorer rank, its roles, the group {policy ranks + that scorer}) for every dedicated scorer."""
    rollouts: list[tuple[int, object, object | None]] = field(default_factory=list)
    """A policy rank served by a dedicated rollout rank, and that rollout rank: (the rollout rank, the group
    {the policy ranks it serves + it}, the group {the first of them + it} the weights travel over, or None
    on the other policy ranks). Empty when the policy ranks sample their own rows."""
    clock: PhaseClock = field(default_factory=PhaseClock)
    """Where this process's time goes (monitor/timing.py); the collectives below charge it to `comm`."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def policy_index(self) -> int:
        """Index among the policy ranks (the data-parallel rank)."""
        return self.policy_ranks.index(self.rank)

    @property
    def policy_size(self) -> int:
        return len(self.policy_ranks)

    def dedicated(self, role: str) -> bool:
        return any(role in roles for _, roles, _ in self.scorers)


def env_rank(env: Mapping[str, str] | None = None) -> tuple[int, int, int, int]:
    env = os.environ if env is None else env
    return (
        int(env.get("RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
    )


def init(topo: Topology, *, cpu: bool, timeout_s: int = 600, host_collectives: bool = False) -> Runtime:
    """This process's place (rank from the environment, role and device from the topology), and the
    process groups. The same call for `python` and `torchrun` alike: without torchrun's variables the
    process is rank 0 of 1, picks its device and needs no process group. `host_collectives`: GPU groups
    also get a gloo backend for tensors in host memory (`placement.offload`: FSDP2's offloaded gradients
    are CPU DTensors, and clipping their norm all-reduces on the CPU; NCCL has no CPU backend)."""
    rank, world, _, _ = env_rank()
    places = topo.places()
    here = topo.place(rank, world)
    policy_ranks = [q.rank for q in places if q.role == "policy"]
    device = torch.device("cpu") if cpu else torch.device("cuda", here.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rt = Runtime(rank, world, here.local, here.node, here.role, here.roles, policy_ranks, device)
    if world == 1:
        return rt
    _init_process_group(rank, world, device, timeout_s, host_collectives)
    # Every rank takes part in creating every group (new_group is collective over the world).
    rt.policy_group = dist.new_group(policy_ranks, timeout=timedelta(seconds=timeout_s))
    # One group per scorer: that scorer and the policy ranks of its node (objects travel over gloo).
    for scorer in (q for q in places if q.role == "scorer"):
        node_policy = [q.rank for q in places if q.role == "policy" and q.node == scorer.node]
        group = dist.new_group(
            node_policy + [scorer.rank], timeout=timedelta(seconds=timeout_s), backend="gloo"
        )
        if rank in node_policy or rank == scorer.rank:
            rt.scorers.append((scorer.rank, scorer.roles, group))
    _rollout_groups(rt, places, timeout_s)
    return rt


def _rollout_groups(rt: Runtime, places: list, timeout_s: int) -> None:
    """The groups of each dedicated rollout rank: requests and answers (objects, gloo), and the weight
    push from the first policy rank it serves (tensors: NCCL on GPUs). Policy rank i of a node is served
    by the node's rollout rank i mod their number. Every rank takes part in creating every group."""
    timeout = timedelta(seconds=timeout_s)
    for node in sorted({q.node for q in places}):
        policy = [q.rank for q in places if q.role == "policy" and q.node == node]
        rollout = [q.rank for q in places if q.role == "rollout" and q.node == node]
        for k, r in enumerate(rollout):
            served = policy[k :: len(rollout)]
            if not served:
                continue
            group = dist.new_group(served + [r], timeout=timeout, backend="gloo")
            weights = dist.new_group([served[0], r], timeout=timeout)
            if rt.rank in served or rt.rank == r:
                rt.rollouts.append((r, group, weights if rt.rank in (served[0], r) else None))


def _init_process_group(
    rank: int, world: int, device: torch.device, timeout_s: int, host_collectives: bool = False
) -> None:
    """NCCL on GPUs (plus gloo for host tensors when asked), gloo on the CPU, over torchrun's store
    under a per-attempt prefix."""
    backend = "gloo"
    if device.type == "cuda":
        backend = "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
    # torchrun keeps one store across restarts: without a per-attempt prefix, a restarted worker reads
    # the addresses its dead predecessors published for the sub-groups and fails to connect.
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"/gpufleet/attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def shutdown(rt: Runtime) -> None:
    """barrier + destroy: a gloo run without it was seen to abort at exit."""
    if rt.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(rt: Runtime, value: torch.Tensor | float) -> torch.Tensor:
    """Sum over the policy ranks (identity on one process)."""
    t = (
        value.detach().clone()
        if isinstance(value, torch.Tensor)
        else torch.tensor(float(value), dtype=torch.float64)
    )
    if rt.distributed and rt.policy_size > 1:
        t = t.to(rt.device) if rt.device.type == "cuda" else t
        with rt.clock.phase("comm"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=rt.policy_group)
            t = t.cpu()
    return t.cpu()


def all_gather_rows(rt: Runtime, local: torch.Tensor) -> list[torch.Tensor]:
    """Every policy rank's tensor (same shape on all ranks), in policy-rank order."""
    if not rt.distributed or rt.policy_size == 1:
        return [local]
    x = local.to(rt.device) if rt.device.type == "cuda" else local.contiguous()
    parts = [torch.empty_like(x) for _ in range(rt.policy_size)]
    with rt.clock.phase("comm"):
        dist.all_gather(parts, x, group=rt.policy_group)
        return [p.cpu() for p in parts]


def all_gather_objects(rt: Runtime, obj: object) -> list:
    """Every policy rank's picklable `obj`, in policy-rank order ([obj] on one process)."""
    if not rt.distributed or rt.policy_size == 1:
        return [obj]
    out: list = [None] * rt.policy_size
    with rt.clock.phase("comm"):
        dist.all_gather_object(out, obj, group=rt.policy_group)
    return out


def all_true(rt: Runtime, flag: bool) -> bool:
    """True when `flag` holds on every policy rank (used to end FSDP generation together)."""
    if not rt.distributed or rt.policy_size == 1:
        return flag
    t = torch.tensor(
        [0 if flag else 1], dtype=torch.int32, device=rt.device if rt.device.type == "cuda" else "cpu"
    )
    with rt.clock.phase("comm"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=rt.policy_group)
        return int(t.item()) == 0
