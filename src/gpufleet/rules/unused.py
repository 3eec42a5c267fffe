"""Fields a job sets that have no effect in this job: the `env:` section of a job without an environment
(env.name unset), the `script:` section of a job `gpufleet train` runs (it is `gpufleet launch`'s recipe).
Warnings, not errors: the job runs, but not as the field says."""

from __future__ import annotations

from gpufleet.config.schema import SECTIONS
from gpufleet.rules.registry import Context, rule, warn

_TRAINER = {"gradient_accumulation_steps": "train.micro_batch"}
"""script fields whose trainer counterpart has another name (accumulation = per_device_batch / micro_batch)."""


@rule
def env_fields_without_env(ctx: Context):
    if ctx.job.env.name:
        return
    for path in ctx.r.set_fields("env"):
        yield warn(
            [ctx.ref(path), ctx.ref("env.name")],
            f"{path} has no effect in this job: it is read only by an environment job (multi-turn agent RL, "
            "env.name set), and env.name is unset, so this job trains single-turn on data.path"
            + (" with reward.functions / reward.weights." if path == "env.reward_weight" else "."),
            "remove it"
            + ("; weight the rewards with reward.weights" if path == "env.reward_weight" else "")
            + ", or set env.name (builtin:keys, gymnasium:<id>, module:Class)",
        )


@rule
def script_fields_in_a_trainer_job(ctx: Context):
    if ctx.job.script.command:  # a `gpufleet launch` job (check takes its own path unless it has problems)
        return
    for path in ctx.r.set_fields("script"):
        name = path.split(".", 1)[1]
        mine = _TRAINER.get(name, f"train.{name}" if name in SECTIONS["train"].model_fields else None)
        yield warn(
            [ctx.ref(path)],
            f"{path} has no effect in this job: the script: section is the recipe of `gpufleet launch JOB -- "
            "CMD` (anyone's training script), and `gpufleet train` trains with the train: section"
            + (f"; its counterpart there is {mine}." if mine else "."),
            "remove it"
            + (f" and set {mine}" if mine else "")
            + ", or run your script with gpufleet launch JOB -- CMD",
        )
