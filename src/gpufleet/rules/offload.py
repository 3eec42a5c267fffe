"""Rules of `placement.offload`: FSDP2's CPU offload needs GPUs and FSDP over two or more policy ranks."""

from __future__ import annotations

from gpufleet.rules.registry import Context, err, rule


@rule
def offload_needs_fsdp_on_gpus(ctx: Context):
    pl = ctx.job.placement
    if pl.offload == "none":
        return
    refs = [ctx.ref("placement.offload")]
    if ctx.hw.is_cpu:
        yield err(
            refs,
            f"placement.offload={pl.offload} on a CPU run: everything already is in host memory, there is "
            "no device memory to offload from.",
            "--set placement.offload=none",
        )
    elif pl.strategy != "fsdp":
        yield err(
            [*refs, ctx.ref("placement.strategy")],
            f"placement.offload={pl.offload} is FSDP2's CPUOffloadPolicy; placement.strategy={pl.strategy} "
            "cannot offload.",
            "--set placement.strategy=fsdp",
        )
    elif ctx.topo.policy_ranks < 2:
        yield err(
            [*refs, ctx.ref("placement.policy")],
            f"placement.offload={pl.offload} shards with FSDP2 over the policy ranks, and this job has "
            f"{ctx.topo.policy_ranks}.",
            "run 2 or more policy ranks (--gpus 2x24GB), or on one GPU --set model.use_peft=true "
            "(LoRA) or model.dtype=bfloat16 instead",
        )
