"""Which process runs which role on which device: the world a job asks for.

Every node is laid out alike. Policy ranks hold one device each. The reference and reward models
are either colocated (a copy inside every policy rank) or dedicated: each device id named for them
gets one scorer rank that holds every role placed on that id. On the CPU, device ids name CPU
processes, so a GPU layout runs unchanged (slowly) on a laptop.

`resolve_topology` never raises: what does not add up becomes a Problem naming every factor. It also
derives train.per_device_batch from train.global_batch once the number of policy ranks is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.config.batch import apply_global_batch
from gpufleet.config.load import Resolved
from gpufleet.config.problems import Problem
from gpufleet.hardware import Hardware
from gpufleet.text import plural

ROLES = ("reference", "reward")


@dataclass(frozen=True)
class RankPlace:
    """Where one global rank runs and what it does."""

    rank: int
    node: int
    local: int
    role: str  # "policy", "scorer" or "rollout"
    device: int
    roles: tuple[str, ...] = ()  # for a scorer: the models it holds


@dataclass(frozen=True)
class Topology:
    """The world of one job. It checks itself when built (as torchtitan's ParallelDims): a layout that
    does not add up raises with every factor named; job-level mistakes are Problems from resolve_topology."""

    nnodes: int
    policy_devices: tuple[int, ...]
    """Device ids of the policy ranks on each node, in rank order."""
    scorer_devices: tuple[tuple[int, tuple[str, ...]], ...]
    """(device id, roles) of each dedicated scorer rank on each node."""
    cpu: bool
    rollout_devices: tuple[int, ...] = ()
    """Device ids of the dedicated rollout ranks on each node (empty: each policy rank samples its rows)."""

    def __post_init__(self) -> None:
        bad = []
        if self.nnodes < 1:
            bad.append(f"nnodes {self.nnodes} < 1")
        if len(set(self.policy_devices)) != len(self.policy_devices):
            bad.append(f"policy devices {list(self.policy_devices)} repeat an id")
        ids = [d for d, _ in self.scorer_devices]
        if len(set(ids)) != len(ids):
            bad.append(f"scorer devices {ids} repeat an id")
        if len(set(self.rollout_devices)) != len(self.rollout_devices):
            bad.append(f"rollout devices {list(self.rollout_devices)} repeat an id")
        for d, roles in self.scorer_devices:
            if not roles or not set(roles) <= set(ROLES):
                bad.append(f"scorer device {d} holds {list(roles)} (roles: {', '.join(ROLES)})")
        if bad:
            raise ValueError(
                f"inconsistent topology: {'; '.join(bad)} (nnodes {self.nnodes}, policy "
                f"{list(self.policy_devices)}, scorers {list(self.scorer_devices)}, rollout {list(self.rollout_devices)})"
            )

    @property
    def nproc_per_node(self) -> int:
        return len(self.policy_devices) + len(self.scorer_devices) + len(self.rollout_devices)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def policy_ranks(self) -> int:
        return len(self.policy_devices) * self.nnodes

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device id a rank of a node uses (policy and scorer), each once, in order."""
        return tuple(
            sorted({*self.policy_devices, *(d for d, _ in self.scorer_devices), *self.rollout_devices})
        )

    def dedicated_roles(self) -> set[str]:
        return {role for _, roles in self.scorer_devices for role in roles}

    def places(self) -> list[RankPlace]:
        """Every global rank in order: on each node the policy ranks first, then the scorer ranks, then the
        rollout ranks."""
        out = []
        for n in range(self.nnodes):
            base = n * self.nproc_per_node
            out += [RankPlace(base + i, n, i, "policy", d) for i, d in enumerate(self.policy_devices)]
            first = base + len(self.policy_devices)
            out += [
                RankPlace(first + s, n, len(self.policy_devices) + s, "scorer", d, tuple(roles))
                for s, (d, roles) in enumerate(self.scorer_devices)
            ]
            first += len(self.scorer_devices)
            out += [
                RankPlace(first + k, n, first - base + k, "rollout", d)
                for k, d in enumerate(self.rollout_devices)
            ]
        return out

    def place(self, rank: int, world_size: int) -> RankPlace:
        """This rank's place; the world torchrun started must be the one the job asks for."""
        if world_size not in (1, self.world_size) or not 0 <= rank < max(world_size, 1):
            from gpufleet.errors import UserError

            raise UserError(
                f"rank {rank} of a world of {world_size} (RANK / WORLD_SIZE in the environment), but the job's "
                f"layout needs {plural(self.world_size, 'process')} ({plural(self.nnodes, 'node')} x "
                f"{len(self.policy_devices)} policy + {len(self.scorer_devices)} scorer + {len(self.rollout_devices)} "
                "rollout)",
                fix="start it with `gpufleet train` (it runs torchrun itself); if RANK / WORLD_SIZE are left "
                "over in your shell, unset them",
            )
        return self.places()[rank]

    def describe(self) -> str:
        unit = "cpu process" if self.cpu else "device"
        ids = list(self.policy_devices)
        many = len(ids) > 1
        text = f"{plural(self.policy_ranks, 'policy rank')} on {unit}{('es' if self.cpu else 's') if many else ''} {ids}"
        if self.nnodes > 1:
            text += f" of each of {self.nnodes} nodes"
        for dev, roles in self.scorer_devices:
            text += f"; {'+'.join(roles)} on scorer {unit} {dev}"
        for dev in self.rollout_devices:
            text += f"; rollout on {unit} {dev}"
        return text


def _ids(value) -> list[int] | None:
    return list(value) if isinstance(value, list) else None


def resolve_topology(r: Resolved, hw: Hardware) -> tuple[Topology, list[Problem]]:
    """The job's world on this hardware, and every problem with it (see the module docstring)."""
    problems: list[Problem] = []
    by_device = _dedicated(r)
    scorer = tuple((d, tuple(roles)) for d, roles in sorted(by_device.items()))
    # Devices that exist (GPU) or that the job lists; on the CPU without a list, any id is a process.
    present = list(range(len(hw.devices))) if not hw.is_cpu else None
    allowed = _ids(r.job.placement.devices)
    if allowed is not None and present is not None:
        missing = [d for d in allowed if d not in present]
        if missing:
            problems.append(_missing(r, "placement.devices", missing, hw))
    if allowed is None:
        allowed = present
    rollout = list(dict.fromkeys(_ids(r.job.placement.rollout) or []))
    busy = {d: list(roles) for d, roles in by_device.items()}  # every device a non-policy rank holds
    for d in rollout:
        busy.setdefault(d, []).append("rollout")
    others = len(by_device) + len(rollout)
    policy, nproc = _policy_devices(r, hw, busy, others, allowed, present, problems)
    _check_devices(r, hw, policy, busy, allowed, problems)
    topo = Topology(r.job.launch.nnodes, tuple(policy), scorer, hw.is_cpu, tuple(rollout))
    _check_processes(r, hw, topo, nproc, busy, present, problems)
    _check_rollout(r, topo, problems)
    problems += apply_global_batch(r, topo.policy_ranks)  # per_device_batch follows the rank count
    return topo, problems


def _dedicated(r: Resolved) -> dict[int, list[str]]:
    """Device id -> the roles placed on it. A role with nothing to hold gets no rank (checks warn)."""
    used, pl = r.job.roles_used(), r.job.placement
    by_device: dict[int, list[str]] = {}
    for role in ROLES:
        ids = _ids(getattr(pl, role))
        if ids and used[role]:
            for dev in dict.fromkeys(ids):
                by_device.setdefault(dev, []).append(role)
    return by_device


def _policy_devices(r, hw, by_device, n_scorer, allowed, present, problems) -> tuple[list[int], int | str]:
    """The policy's device ids (given, or the free ones up to nproc_per_node), each once."""
    pl, nproc = r.job.placement, r.job.launch.nproc_per_node
    policy = _ids(pl.policy)
    if policy is not None:
        dup = sorted({d for d in policy if policy.count(d) > 1})
        if dup:
            once = ",".join(map(str, dict.fromkeys(policy)))
            problems.append(
                Problem(
                    "error",
                    [r.ref("placement.policy")],
                    f"device {dup[0]} holds two policy ranks; each policy rank needs its own device.",
                    f"list each device once, e.g. --set placement.policy={once}",
                )
            )
        return list(dict.fromkeys(policy)), nproc
    pool = allowed if allowed is not None else list(range(max(nproc if nproc != "auto" else 1, 1) + n_scorer))
    pool = [d for d in pool if pl.allow_shared_devices or d not in by_device]
    want = (nproc - n_scorer) if nproc != "auto" else len(pool)
    if want > len(pool) and present is not None:
        problems.append(
            Problem(
                "error",
                [r.ref("launch.nproc_per_node"), r.ref("placement.devices")],
                f"launch.nproc_per_node {nproc} needs {want} policy devices + {n_scorer} scorer, "
                f"but {hw.describe()} leaves {len(pool)} for the policy.",
                f"use at most {len(pool) + n_scorer} devices: --set launch.nproc_per_node={len(pool) + n_scorer}, "
                "or run on more GPUs.",
            )
        )
        nproc = "auto"
    return pool[: max(want, 0)], nproc


def _check_devices(r, hw, policy, by_device, allowed, problems) -> None:
    """Every named device is allowed; a device shared by policy and scorer must be declared."""
    pl = r.job.placement
    dedicated_roles = {x for roles in by_device.values() for x in roles}
    for field, ids in (
        ("placement.policy", policy),
        *((f"placement.{d}", _ids(getattr(pl, d)) or []) for d in (*ROLES, "rollout")),
    ):
        missing = [d for d in ids if allowed is not None and d not in allowed]
        if missing and (field == "placement.policy" or field.split(".")[1] in dedicated_roles):
            problems.append(_missing(r, field, missing, hw, allowed))
    shared = sorted(set(policy) & set(by_device))
    if shared and not pl.allow_shared_devices:
        roles = "+".join(dict.fromkeys(x for d in shared for x in by_device[d]))
        rest = [d for d in policy if d not in shared]
        problems.append(
            Problem(
                "error",
                [r.ref("placement.policy"), *(r.ref(f"placement.{x}") for x in roles.split("+"))],
                f"device {shared[0]} is both a policy device and the dedicated {roles} device, and the roles are not declared to share it.",
                "declare it with --set placement.allow_shared_devices=true (two processes on one device, memory split), "
                + (
                    f"or keep the policy off it: --set placement.policy={','.join(map(str, rest))}"
                    if rest
                    else "or colocate: --set placement." + roles.split("+")[0] + "=colocate"
                ),
            )
        )
    if not policy:
        problems.append(
            Problem(
                "error",
                [r.ref("placement.policy"), r.ref("launch.nproc_per_node")],
                "no device is left for a policy rank.",
                "give the policy at least one device, e.g. --set placement.policy=0, or colocate the other roles.",
            )
        )


def _check_processes(r, hw, topo: Topology, nproc, by_device, present, problems) -> None:
    """nproc_per_node agrees with the placement; enough devices (GPU) or cores (CPU) for the processes."""
    policy = topo.policy_devices
    if nproc != "auto" and nproc != topo.nproc_per_node:
        parts = f"{len(policy)} policy + {len(topo.scorer_devices)} scorer"
        parts += f" + {len(topo.rollout_devices)} rollout" if topo.rollout_devices else ""
        problems.append(
            Problem(
                "error",
                [
                    r.ref("launch.nproc_per_node"),
                    r.ref("placement.policy"),
                    r.ref("placement.reference"),
                    r.ref("placement.reward"),
                    r.ref("placement.rollout"),
                ],
                f"launch.nproc_per_node is {nproc} but the placement needs {topo.nproc_per_node} processes per node ({parts}).",
                f"--set launch.nproc_per_node={topo.nproc_per_node} (or auto), or change the placement to fill {nproc} processes.",
            )
        )
    if not hw.is_cpu and topo.nproc_per_node > 0 and present is not None:
        need = len(set(policy) | set(by_device))
        if need > len(present):
            problems.append(
                Problem(
                    "error",
                    [r.ref("launch.nproc_per_node"), r.ref("placement.policy")],
                    f"the job needs {need} devices per node but {hw.describe()} has {len(present)}.",
                    f"use at most {len(present)} devices (e.g. --set launch.nproc_per_node={len(present)}), or run on more GPUs.",
                )
            )
    if hw.is_cpu and topo.world_size > hw.cpu_count and hw.is_detected:
        problems.append(
            Problem(
                "warning",
                [r.ref("launch.nproc_per_node")],
                f"{topo.world_size} processes on {hw.cpu_count} CPU cores: they will share cores and run slowly.",
                f"fine for testing; for speed use at most {hw.cpu_count} processes.",
            )
        )


def _missing(
    r: Resolved, field: str, missing: list[int], hw: Hardware, allowed: list[int] | None = None
) -> Problem:
    if (
        allowed is not None
        and field != "placement.devices"
        and r.source("placement.devices").kind != "default"
    ):
        have = f"placement.devices allows {allowed}"
    else:
        n = len(hw.devices)
        have = f"{hw.describe()} has devices 0..{n - 1}" if n else "there are no devices"
    fix_ids = allowed if allowed is not None else list(range(len(hw.devices)))
    return Problem(
        "error",
        [r.ref(field)],
        f"device {missing[0]} does not exist: {have} (numbered after CUDA_VISIBLE_DEVICES).",
        f"use ids from {fix_ids}" + (f", e.g. --set {field}={fix_ids[0]}" if fix_ids else ""),
    )


def _check_rollout(r, topo: Topology, problems) -> None:
    """Dedicated rollout ranks: each serves whole policy ranks of its node, on a device of its own unless
    sharing is declared."""
    rollout, pl = topo.rollout_devices, r.job.placement
    if not rollout:
        return
    policy = topo.policy_devices
    if policy and len(rollout) > len(policy):
        problems.append(
            Problem(
                "error",
                [r.ref("placement.rollout"), r.ref("placement.policy")],
                f"{plural(len(rollout), 'rollout device')} {list(rollout)} for {plural(len(policy), 'policy rank')} "
                "per node: each rollout rank generates the rows of whole policy ranks, so one would be idle.",
                f"use at most {len(policy)}: --set placement.rollout={','.join(map(str, rollout[: len(policy)]))}",
            )
        )
    shared = sorted(set(rollout) & {d for d, _ in topo.scorer_devices})
    if shared and not pl.allow_shared_devices:
        problems.append(
            Problem(
                "error",
                [r.ref("placement.rollout"), r.ref("placement.reference"), r.ref("placement.reward")],
                f"device {shared[0]} holds both a rollout rank and a scorer rank, and the roles are not declared "
                "to share it.",
                "declare it with --set placement.allow_shared_devices=true (two processes on one device, memory "
                "split), or give the rollout rank a device of its own.",
            )
        )
