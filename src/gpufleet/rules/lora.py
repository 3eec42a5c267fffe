"""Rules of a LoRA job (`model.use_peft`): the target modules exist in the model (and the count the
planner uses can be made), a dedicated reference device has nothing to hold."""

from __future__ import annotations

from gpufleet.errors import UserError
from gpufleet.rules.registry import Context, err, rule, warn


@rule
def lora_targets_exist(ctx: Context):
    m = ctx.job.model
    if not m.use_peft or ctx.model is None:
        return
    from gpufleet.models.lora import trainable_parameters

    raw = ctx.model.raw
    if "intermediate_size" not in raw or "hidden_size" not in raw:
        return  # not a Llama-family config: peft itself checks the names when the model loads
    try:
        trainable_parameters(raw, m)
    except UserError as e:
        yield err([ctx.ref("model.lora_target_modules"), ctx.ref("model.path")], e.message, e.fix)


@rule
def lora_reference_is_the_base(ctx: Context):
    job = ctx.job
    if job.model.use_peft and job.algorithm.beta > 0 and isinstance(job.placement.reference, list):
        yield warn(
            [ctx.ref("placement.reference"), ctx.ref("model.use_peft")],
            "with LoRA the KL reference is the base model inside the policy (the adapter switched off): "
            "no reference model is loaded, so placement.reference has nothing to place.",
            "drop placement.reference",
        )
