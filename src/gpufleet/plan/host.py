"""Host RAM of one node of a GPU plan (`loads.HostLoad`): what `placement.offload` keeps there, the peak
while the models load, and an overhead per process. No torch import.

Loading. Every process builds each model it loads whole on the CPU (`from_pretrained`, in the dtype it
trains or scores in) and then moves it to its GPU (`.to`: DDP, one rank, a scorer) or shards it there
(FSDP2 `fully_shard` moves one unit at a time and the CPU copy is freed). In its checkpoint's dtype
the weights are the safetensors file mapped into memory (transformers 5 maps it; measured: +10 MiB of
RSS for an 80 MiB bf16 model, its pages then shared by the node's processes as reclaimable page cache):
not counted. In another dtype (fp32 master weights from a bf16 checkpoint, the usual full fine-tuning)
every parameter is converted into the process's own memory (measured: +159 MiB for the same model in
fp32). Its models load one after another (policy, reference, reward model), so a process's peak is its
largest converted model, plus, under offload, the policy shards already in host RAM; the processes of a
node load at once, so the node's peak is their sum: 4 FSDP ranks of a bf16 7B in fp32 take 4 x 30.5 GB.
gpufleet counts this copy rather than avoiding it: building the model on the meta device on ranks > 0
and broadcasting rank 0's weights (`set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`) would leave one copy per node, but the buffers a state dict does not hold
(rotary `inv_freq`) and tied weights would then have to be rebuilt by hand for every model family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpufleet.hardware import Hardware
from gpufleet.plan.loads import HostLoad
from gpufleet.plan.memory import DTYPE_BYTES
from gpufleet.plan.overhead import HOST_OVERHEAD
from gpufleet.topology import Topology


def converted_bytes(parameters: int, load_dtype: str, checkpoint_dtype: str | None) -> int:
    """Host bytes a process holds for a model it builds whole on the CPU: 0 when it loads in its
    checkpoint's dtype (the file mapped, see above), else every parameter converted to `load_dtype`
    (an unknown checkpoint dtype counts as converted)."""
    if load_dtype == checkpoint_dtype:
        return 0
    return parameters * DTYPE_BYTES[load_dtype]


@dataclass(frozen=True)
class Whole:
    """The models a process converts whole on the CPU while loading (bytes, `converted_bytes`)."""

    policy: int
    reference: int = 0
    """The reference (0: none in the job, e.g. beta 0 or LoRA, whose reference is the policy's base)."""
    reward_model: int = 0
    resident: int = 0
    """Offload: one policy rank's sharded weights, already in host RAM when its other models load."""


def policy_loading(whole: Whole, reference: bool, reward_model: bool) -> int:
    """Peak host bytes of one policy rank while it loads the policy and its colocated roles."""
    after = [whole.reference if reference else 0, whole.reward_model if reward_model else 0]
    return max([whole.policy] + [whole.resident + b for b in after if b])


def scorer_loading(whole: Whole, roles: tuple[str, ...], used: Mapping[str, bool]) -> int:
    """Peak host bytes of a dedicated scorer rank while it loads the roles it holds."""
    sizes = {"reference": whole.reference, "reward": whole.reward_model}
    return max([0] + [sizes[r] for r in roles if used.get(r) and r in sizes])


def host_load(
    hw: Hardware,
    topo: Topology,
    offloaded_per_rank: int,
    whole: Whole,
    colocated: Mapping[str, bool],
    used: Mapping[str, bool],
) -> HostLoad:
    """Host RAM of one node: what its policy ranks offload, its processes' loading peak, and
    HOST_OVERHEAD per process. `colocated`: {"reference": .., "reward": ..} held by the policy ranks."""
    policy = policy_loading(whole, colocated["reference"], colocated["reward"])
    loading = len(topo.policy_devices) * policy + sum(
        scorer_loading(whole, roles, used) for _, roles in topo.scorer_devices
    )
    procs = topo.nproc_per_node
    return HostLoad(
        capacity=hw.ram_bytes,
        source=hw.ram_source,
        offloaded=len(topo.policy_devices) * offloaded_per_rank,
        overhead=procs * HOST_OVERHEAD,
        processes=procs,
        checked=True,
        loading=loading,
    )
