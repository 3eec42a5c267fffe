"""The bytes of every process of a job whose layout is decided: the per-process accounting of a `Plan`.

    plan = build(r, hw, topo, models, env)     # no choices made here; search.py makes them

Each policy rank holds the policy (a full replica with DDP, a 1/N shard with FSDP), its rollout (KV
cache), its training activations, and every role that is colocated (the reference model when beta > 0,
the reward model when set; under FSDP both are sharded like the policy); each dedicated scorer rank holds the roles placed on its device. `other`
is the framework overhead per process (`overhead.py`), the generation batch's tensors and, with FSDP,
the all-gathered root module plus two layers (current and prefetched) and one layer's unsharded
gradient. No torch import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpufleet.config import precision
from gpufleet.config.load import Resolved
from gpufleet.engine.switches import FUSED_LAYERS, FUSED_LOGPROBS, switched_off
from gpufleet.hardware import Hardware
from gpufleet.plan.host import Whole, converted_bytes, host_load
from gpufleet.plan.inference import (
    REWARD_MODEL_BATCH,
    decode_precision,
    fast_decode_copies,
    logprob_scoring_bytes,
    reward_model_bytes,
    rollout_bytes,
)
from gpufleet.plan.loads import DeviceLoad, HostLoad, Plan, ProcessLoad
from gpufleet.plan.memory import (
    Activations,
    Precision,
    train_activations,
    train_state_bytes,
    training_precision,
    with_adapter,
)
from gpufleet.plan.overhead import overhead_bytes
from gpufleet.plan.rollout import pushing, rollout_process
from gpufleet.plan.shape import Models, adapter_parameters, lora_config
from gpufleet.topology import Topology


def micro_batch(r: Resolved) -> int:
    """The micro-batch the trainer runs: train.micro_batch within 1..per_device_batch."""
    t = r.job.train
    return max(1, min(t.micro_batch or t.per_device_batch, t.per_device_batch))


def roles_in_use(r: Resolved) -> dict[str, bool]:
    """Whether the job has a reference model and a reward model (`Job.roles_used`: a LoRA policy's
    reference is its own base model, no role of its own)."""
    return r.job.roles_used()


@dataclass(frozen=True)
class Layout:
    """What the topology and the job decided: the policy's strategy and where the scoring roles run."""

    strategy: str
    """`single` (one policy rank), `ddp` or `fsdp`."""
    shards: int
    reference: str
    """`none`, `colocate` or `dedicated`."""
    reward_model: str
    """`none`, `colocate`, `dedicated` or `unsized` (its config is not available)."""
    offload: bool = False
    """FSDP with `placement.offload`: the policy's training state in host memory."""


def layout_of(r: Resolved, topo: Topology, models: Models, hw_is_cpu: bool = False) -> Layout:
    ranks = topo.policy_ranks
    strategy = "single" if ranks == 1 else r.job.placement.strategy
    used, dedicated = roles_in_use(r), topo.dedicated_roles()
    reference = "none" if not used["reference"] else ("dedicated" if "reference" in dedicated else "colocate")
    if not used["reward"]:
        reward = "none"
    elif models.reward is None:
        reward = "unsized"
    else:
        reward = "dedicated" if "reward" in dedicated else "colocate"
    offload = strategy == "fsdp" and r.job.placement.offload != "none" and not hw_is_cpu
    return Layout(strategy, ranks if strategy == "fsdp" else 1, reference, reward, offload)


@dataclass(frozen=True)
class Parts:
    """The bytes the processes of this job are made of."""

    state: dict[str, int]
    acts: Activations
    roll: dict[str, int]
    ref_weights: int
    ref_scoring: int
    old_scoring: int
    """Old log-probs of the policy (only when a generation batch feeds more than one optimizer step)."""
    rm_weights: int
    rm_work: int
    batch_tensors: int
    gather: int
    """FSDP: the root unit gathered fwd->bwd, the current and prefetched layer, one layer's grads."""
    overhead: int
    optimizer_step: int
    """AdamW's temporaries on the GPU (0 on the CPU, where nothing is preallocated)."""
    ref_gather: int = 0
    """A sharded reference (FSDP): its root unit and two layers gathered while it scores."""
    rm_gather: int = 0
    """A sharded reward model (FSDP, colocated): its root unit and two layers gathered while it scores."""
    host_state: int = 0
    """Offload: one policy rank's weights, grads, AdamW states and step temporary in host memory."""
    whole: Whole = Whole(0)
    """The models whole in their load dtypes: what a process briefly holds in host RAM while loading."""
    grads_freed: dict[str, int] = field(default_factory=dict)
    """Bytes of the policy's gradients a phase does not hold (`_grads_freed`)."""


def _activations(job, pol, run: Precision, sizes: dict, cpu: bool, env: Mapping[str, str]) -> Activations:
    """One training micro-batch's activations (memory.py), with a LoRA adapter's when there is one."""
    fused = cpu and not switched_off(FUSED_LAYERS, env)
    acts = train_activations(
        pol.arch,
        pol.params,
        run,
        checkpointing=job.model.gradient_checkpointing,
        fused_cpu=fused,
        head_trained=not job.model.use_peft,  # LoRA: the base model's head is frozen
        **sizes,
    )
    if not job.model.use_peft:
        return acts
    from gpufleet.models.lora import adapted_width

    tokens = sizes["batch"] * (sizes["prompt_tokens"] + sizes["completion_tokens"])
    width = adapted_width(lora_config(pol.arch), job.model)
    return with_adapter(acts, adapter_parameters(job, pol.arch), width, tokens, run)


def _grads_freed(grads: int, acts: Activations, single: bool) -> dict[str, int]:
    """The gradients' bytes each phase runs without: the trainer frees them after each optimizer step
    (rl/trainer.py), so rollout and scoring hold none (DDP's buckets stay). `single`: one micro-batch per
    optimizer step on a GPU, whose backward makes the gradients layer by layer as it frees that layer's
    activations, so its peak is the larger of the two ends, all activations with the backward's working
    set or all gradients with it, not their sum (on a CPU the trainer may cut a micro-batch in two by
    length, rl/batch.py, and the second part meets the first's gradients)."""
    freed = {"rollout": grads, "scoring": grads}
    if single:
        freed["train"] = min(grads, acts.peak - acts.backward)
    return freed


def parts_of(r: Resolved, hw: Hardware, models: Models, lay: Layout, env: Mapping[str, str]) -> Parts:
    job, pol = r.job, models.policy
    t, P, T = job.train, job.rollout.max_prompt_length, job.completion_tokens()
    prec = training_precision(precision.weights_dtype(job), t.precision)
    micro = micro_batch(r)
    rows = t.per_device_batch * t.steps_per_generation
    fsdp = lay.strategy == "fsdp"
    state = train_state_bytes(
        pol.params,
        prec,
        shards=lay.shards,
        ddp_buckets=lay.strategy == "ddp",
        fused_adamw=not fsdp,
        adapter=adapter_parameters(job, pol.arch),
    )
    host_state = 0
    whole = _whole(job, models, prec, state["weights"] if lay.offload else 0)
    if lay.offload:  # CPUOffloadPolicy: the sharded state and the optimizer step live in host memory
        host_state = state["weights"] + state["grads"] + state["optimizer"] + state["optimizer_step"]
        state = {**{k: 0 for k in state}, "ddp_buckets": 0}
    # FSDP2 mixed precision (config/precision.py): the forward sees compute-dtype parameters, as a model
    # of that dtype would (no autocast copies); the gathered units are in the compute dtype too.
    mixed = precision.fsdp_mixed(job, lay.shards)
    run = Precision(prec.compute, prec.compute) if mixed else prec
    ref = Precision(precision.reference_dtype(job), precision.reference_dtype(job))
    # the head's log-probs chunk by chunk where the trainer does it (engine/logprobs.py's switch)
    sizes = {"batch": micro, "prompt_tokens": P, "completion_tokens": T}
    sizes["fused_logprobs"] = not switched_off(FUSED_LOGPROBS, env)
    copies = fast_decode_copies(pol.arch, run, wrapped=fsdp, cpu=hw.is_cpu)
    several_steps = t.steps_per_generation * job.algorithm.num_iterations > 1
    rm_shards = lay.shards if fsdp and lay.reward_model == "colocate" else 1
    rm_weights, rm_work, rm_gather = reward_model_parts(job, models, rows, P + T, rm_shards)
    gathered = run.compute_bytes if mixed else prec.weight_bytes
    units = pol.params.root + 3 * pol.params.per_layer  # FSDP: root + current and prefetched layer + grads
    # A sharded reference's no-grad forward: its root unit and two layers gathered (released after).
    sharded_ref = fsdp and lay.reference == "colocate"
    ref_gather = (pol.params.root + 2 * pol.params.per_layer) * ref.weight_bytes if sharded_ref else 0
    # Offload: each unit's shard is copied to the GPU for its all-gather (and its grads back).
    staging = math.ceil(units * prec.weight_bytes / lay.shards) if lay.offload else 0
    acts = _activations(job, pol, run, sizes, hw.is_cpu, env)
    return Parts(
        state=state,
        acts=acts,
        grads_freed=_grads_freed(state["grads"], acts, single=micro == t.per_device_batch and not hw.is_cpu),
        roll=rollout_bytes(
            pol.arch,
            decode_precision(pol.arch, run, wrapped=fsdp, cpu=hw.is_cpu),
            sequences=rows,
            prompt_tokens=P,
            completion_tokens=T,
            weight_copies=copies,
        ),
        # frozen, in the compute dtype (reference_dtype); under FSDP sharded like the policy
        ref_weights=math.ceil(pol.params.total / (lay.shards if sharded_ref else 1)) * ref.weight_bytes,
        ref_scoring=ref_gather
        + logprob_scoring_bytes(pol.arch, pol.params, ref, cached_weight_copies=False, **sizes),
        ref_gather=ref_gather,
        old_scoring=logprob_scoring_bytes(pol.arch, pol.params, run, cached_weight_copies=True, **sizes)
        if several_steps
        else 0,
        rm_weights=rm_weights,
        rm_work=rm_work,
        rm_gather=rm_gather,
        batch_tensors=rows * (P + T) * 8 * 4 + rows * T * 4 * 4,
        gather=units * gathered + staging if fsdp else 0,
        host_state=host_state,
        whole=whole,
        overhead=overhead_bytes(env, gpu=not hw.is_cpu),
        optimizer_step=0 if hw.is_cpu else state["optimizer_step"],
    )


def reward_model_parts(job, models: Models, rows: int, tokens: int, shards: int) -> tuple[int, int, int]:
    """(weights, one forward's working set, gathered units) of the reward model, frozen in the compute
    dtype (config/precision.py `reward_model_dtype`). `shards` > 1 (FSDP, colocated): 1/N of its weights
    per policy rank, and its root unit and two layers gathered while it scores, as the reference."""
    rm = models.reward
    if rm is None:
        return 0, 0, 0
    dtype = precision.reward_model_dtype(job)
    prec = Precision(dtype, dtype)
    work = reward_model_bytes(rm.arch, prec, batch=min(REWARD_MODEL_BATCH, rows), tokens=tokens)
    gather = (rm.params.root + 2 * rm.params.per_layer) * prec.weight_bytes if shards > 1 else 0
    return math.ceil(rm.params.total / shards) * prec.weight_bytes, work + gather, gather


def _whole(job, models: Models, prec: Precision, resident: int) -> Whole:
    """What loading converts whole on the CPU per process (plan/host.py): the policy in its weights'
    dtype, the reference and the reward model in the compute dtype; `resident`: offloaded shards."""
    pol, rm = models.policy, models.reward
    ckpt = pol.arch.checkpoint_dtype
    return Whole(
        policy=converted_bytes(pol.params.total, prec.weights, ckpt),
        reference=converted_bytes(pol.params.total, precision.reference_dtype(job), ckpt),
        reward_model=0
        if rm is None
        else converted_bytes(rm.params.total, precision.reward_model_dtype(job), rm.arch.checkpoint_dtype),
        resident=resident,
    )


def policy_process(i: int, parts: Parts, lay: Layout) -> ProcessLoad:
    """Policy rank `i` with the roles colocated on it."""
    state, acts, roll = parts.state, parts.acts, parts.roll
    detail = {
        "policy_weights": state["weights"],
        "grads": state["grads"],
        "ddp_buckets": state["ddp_buckets"],
        "adamw_states": state["optimizer"],
        "saved_activations": acts.saved,
        "autocast_weight_copies": acts.weight_copies + acts.head_weight_copy,
        "logits": acts.logits,
        "backward_working_set": acts.backward,
        "kv_cache": roll["kv_cache"],
        "prefill": roll["prefill"],
        "sampling": roll["sampling"],
        "decoder_weight_copies": roll["decoder_weight_copies"],
        "overhead": parts.overhead,
        "batch_tensors": parts.batch_tensors,
        "fsdp_gathered": parts.gather,
        "offloaded_to_host": parts.host_state,
    }
    weights, scoring, role = state["weights"], parts.old_scoring, f"policy rank {i}"
    if lay.reference == "colocate":
        weights += parts.ref_weights
        detail["reference_weights"] = parts.ref_weights
        detail["reference_gathered"] = parts.ref_gather
        scoring = max(scoring, parts.ref_scoring)
        role += " + reference"
    if lay.reward_model == "colocate":
        weights += parts.rm_weights
        detail["reward_model_weights"] = parts.rm_weights
        detail["reward_model_gathered"] = parts.rm_gather
        scoring = max(scoring, parts.rm_work)
        role += " + reward model"
    phases = {
        "train": acts.peak,
        "rollout": roll["peak"],
        "scoring": scoring,
        "optimizer step": parts.optimizer_step,
    }
    return ProcessLoad(
        role=role,
        weights=weights,
        grads=state["grads"] + state["ddp_buckets"],
        optimizer=state["optimizer"],
        other=parts.overhead + parts.batch_tensors + parts.gather,
        phases=phases,
        detail=detail,
        freed=parts.grads_freed,
    )


def scorer_process(
    roles: tuple[str, ...], parts: Parts, used: Mapping[str, bool], received: int
) -> ProcessLoad:
    """A dedicated scorer rank holding `roles` (those the job uses); `received`: the batches sent to it."""
    weights, work, names, detail = 0, 0, [], {"overhead": parts.overhead}
    if "reference" in roles and used["reference"]:
        weights += parts.ref_weights
        work = max(work, parts.ref_scoring)
        names.append("reference")
        detail["reference_weights"] = parts.ref_weights
    if "reward" in roles and used["reward"]:
        weights += parts.rm_weights
        work = max(work, parts.rm_work)
        names.append("reward model")
        detail["reward_model_weights"] = parts.rm_weights
    detail["received_batches"] = received
    return ProcessLoad(
        role="scorer: " + " + ".join(names),
        weights=weights,
        grads=0,
        optimizer=0,
        other=parts.overhead + received,
        phases={"scoring": work},
        detail=detail,
    )


def _devices(hw: Hardware, per_device: dict[int, list[ProcessLoad]]) -> list[DeviceLoad]:
    if hw.is_cpu:
        procs = [p for dev in sorted(per_device) for p in per_device[dev]]
        return [DeviceLoad("cpu", None, "CPU RAM", hw.ram_bytes, procs)]
    out = []
    for dev in sorted(per_device):
        d = hw.devices[dev] if 0 <= dev < len(hw.devices) else None
        out.append(
            DeviceLoad(str(dev), dev, d.name if d else "?", d.total_bytes if d else 0, per_device[dev])
        )
    return out


def build(r: Resolved, hw: Hardware, topo: Topology, models: Models, env: Mapping[str, str]) -> Plan:
    """The per-device loads of a job whose topology is valid (no choices made here)."""
    job, t = r.job, r.job.train
    lay = layout_of(r, topo, models, hw.is_cpu)
    parts = parts_of(r, hw, models, lay, env)
    if topo.rollout_devices:  # the rollout ranks sample: no KV cache, prefill or sampler on a policy rank
        parts = replace(parts, roll=dict.fromkeys(parts.roll, 0))
    received = topo.policy_ranks * parts.batch_tensors // max(topo.nnodes, 1)
    per_device: dict[int, list[ProcessLoad]] = {}
    for i, dev in enumerate(topo.policy_devices):
        load = policy_process(i, parts, lay)
        if topo.rollout_devices:
            load = pushing(load, r, models, lay.strategy == "fsdp")
        per_device.setdefault(dev, []).append(load)
    for dev, roles in topo.scorer_devices:
        per_device.setdefault(dev, []).append(scorer_process(roles, parts, roles_in_use(r), received))
    for k, dev in enumerate(topo.rollout_devices):
        load = rollout_process(k, r, hw, topo, models, parts.overhead, parts.batch_tensors, micro_batch(r))
        per_device.setdefault(dev, []).append(load)
    return Plan(
        hardware=hw,
        models=models,
        topo=topo,
        strategy=lay.strategy,
        shards=lay.shards,
        checkpointing=job.model.gradient_checkpointing,
        precision=training_precision(precision.weights_dtype(job), t.precision),
        per_device_batch=t.per_device_batch,
        micro_batch=micro_batch(r),
        rollout_rows=t.per_device_batch * t.steps_per_generation,
        prompt_tokens=job.rollout.max_prompt_length,
        completion_tokens=job.completion_tokens(),
        reference=lay.reference,
        reward_model=lay.reward_model,
        devices=_devices(hw, per_device),
        host=None if hw.is_cpu else _host(hw, topo, parts, lay, roles_in_use(r)),
    )


def _host(hw: Hardware, topo: Topology, parts: Parts, lay: Layout, used: Mapping[str, bool]) -> HostLoad:
    """Host RAM of one node (plan/host.py): offloaded state, the loading peak, overhead per process."""
    colocated = {"reference": lay.reference == "colocate", "reward": lay.reward_model == "colocate"}
    return host_load(hw, topo, parts.host_state, parts.whole, colocated, used)
