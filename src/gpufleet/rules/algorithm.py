"""Rules of the GRPO family's options: the combinations TRL 1.16 warns about or refuses, and settings that do
nothing."""

from __future__ import annotations

from gpufleet.rules.registry import Context, err, rule, warn

_SUMMING = ("bnpo", "dr_grpo", "dapo", "cispo")


@rule
def loss_type_and_level(ctx: Context):
    a = ctx.job.algorithm
    refs = [ctx.ref("algorithm.loss_type"), ctx.ref("algorithm.importance_level")]
    if a.loss_type == "luspo" and a.importance_level == "token":
        yield warn(
            refs,
            "luspo is a sequence-level loss (a modification of GSPO); at importance_level token it is not the "
            "paper's method (TRL warns likewise).",
            "--set algorithm.importance_level=sequence (or --set algorithm.name=luspo)",
        )
    if a.loss_type == "vespo" and a.importance_level == "sequence":
        yield warn(
            refs,
            "vespo builds its sequence weight from the token log-ratios itself; importance_level sequence only "
            "changes the KL correction (TRL warns likewise).",
            "--set algorithm.importance_level=token",
        )
    if a.importance_level == "sequence" and a.loss_type in _SUMMING:
        yield warn(
            refs,
            f"at importance_level sequence, {a.loss_type} sums per-token terms, which weights each sequence by "
            "its length instead of optimising the per-sequence objective (GSPO uses grpo; TRL warns likewise).",
            "--set algorithm.loss_type=grpo",
        )


@rule
def clip_options(ctx: Context):
    a = ctx.job.algorithm
    high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    if a.delta is not None and high is not None and a.loss_type not in ("cispo", "sapo", "vespo"):
        if a.delta <= 1 + high:
            yield warn(
                [ctx.ref("algorithm.delta"), ctx.ref("algorithm.epsilon_high")],
                f"delta {a.delta} <= 1 + epsilon_high = {1 + high:g}: the two-sided clip cuts below the PPO "
                "clip's upper bound (INTELLECT-2 uses delta > 1 + epsilon).",
                f"--set algorithm.delta={max(4.0, round(1 + high + 0.5, 2))}",
            )
    if a.delta is not None and a.loss_type in ("cispo", "sapo", "vespo"):
        yield warn(
            [ctx.ref("algorithm.delta"), ctx.ref("algorithm.loss_type")],
            f"delta applies to the PPO clip only; {a.loss_type} ignores it.",
            "drop algorithm.delta",
        )
    if a.loss_type == "cispo" and high is not None and high <= 1:
        yield warn(
            [ctx.ref("algorithm.epsilon_high"), ctx.ref("algorithm.loss_type")],
            f"cispo caps the IS weight at epsilon_high itself ({high:g}), not at 1 + epsilon_high: every "
            "on-policy token would be down-weighted (ScaleRL and TRL recommend 5.0).",
            "--set algorithm.epsilon_high=5.0 (or --set algorithm.name=cispo)",
        )


@rule
def options_that_do_nothing(ctx: Context):
    a, job = ctx.job.algorithm, ctx.job
    if a.off_policy_mask_threshold is not None and job.train.steps_per_generation * a.num_iterations == 1:
        yield warn(
            [ctx.ref("algorithm.off_policy_mask_threshold"), ctx.ref("algorithm.num_iterations")],
            "the off-policy mask compares with the policy that generated the batch, which is the current one "
            "when every batch is used once: it drops nothing.",
            "--set algorithm.num_iterations=2 or train.steps_per_generation=2, or drop the threshold",
        )
    if a.mask_truncated_completions and job.env.name:
        yield warn(
            [ctx.ref("algorithm.mask_truncated_completions"), ctx.ref("env.name")],
            "mask_truncated_completions applies to single-turn completions; an env job's episodes are not masked.",
            "drop algorithm.mask_truncated_completions",
        )


@rule
def reference_sync(ctx: Context):
    a, job = ctx.job.algorithm, ctx.job
    if not a.sync_ref_model:
        return
    ref = [ctx.ref("algorithm.sync_ref_model")]
    if a.beta == 0:
        yield err(
            [*ref, ctx.ref("algorithm.beta")],
            "beta is 0: no reference model is used, so there is nothing to sync (TRL refuses this too).",
            "--set algorithm.beta=0.04, or drop algorithm.sync_ref_model",
        )
    if job.model.use_peft:
        yield err(
            [*ref, ctx.ref("model.use_peft")],
            "with LoRA the reference is the base model inside the policy: it cannot move (TRL refuses this too).",
            "drop algorithm.sync_ref_model, or train every weight (model.use_peft=false)",
        )
    if job.placement.strategy == "fsdp" and ctx.topo.policy_ranks > 1:
        yield err(
            [*ref, ctx.ref("placement.strategy")],
            "reference sync mixes the full policy weights into the reference; under FSDP they are sharded "
            "(not supported yet).",
            "--set placement.strategy=ddp",
        )


@rule
def router_aux_loss(ctx: Context):
    """A router load-balancing weight for a model that has no router (TRL raises on it too)."""
    from gpufleet.models.info import router_aux_coef

    coef = ctx.job.algorithm.router_aux_loss_coef
    if not coef or ctx.model is None:
        return
    try:
        router_aux_coef(coef, ctx.model.raw)
    except ValueError as e:
        yield err(
            [ctx.ref("algorithm.router_aux_loss_coef"), ctx.ref("model.path")], f"{e}.", "remove it (or 0)"
        )


@rule
def adaptive_entropy_bounds(ctx: Context):
    """The adaptive entropy bonus moves its coefficient within [entropy_coef_min, entropy_coef_max]."""
    a = ctx.job.algorithm
    if a.use_adaptive_entropy and a.entropy_coef_min > a.entropy_coef_max:
        yield err(
            [ctx.ref("algorithm.entropy_coef_min"), ctx.ref("algorithm.entropy_coef_max")],
            f"entropy_coef_min {a.entropy_coef_min:g} > entropy_coef_max {a.entropy_coef_max:g}: the adaptive "
            "entropy bonus has no range to move its coefficient in.",
            f"--set algorithm.entropy_coef_max={a.entropy_coef_min:g} (or a lower entropy_coef_min)",
        )
