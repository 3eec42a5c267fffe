"""The values of TRL options that gpufleet computes from several settings or from TRL's meaning: TRL's batch
names together (`batch`: per_device_train_batch_size counts one forward pass, gpufleet's per_device_batch an
optimizer step) and TRL's values of fields of the same name that gpufleet spells otherwise (`value`:
scale_rewards true / false, a warmup_steps fraction). The names themselves are gpufleet.config.trl's map."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from gpufleet.config.trl import as_bool

BATCH = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "per_device_batch",
)
"""The names whose gpufleet values are computed together (`batch`): TRL's batch per forward pass, its
accumulation and its steps_per_generation (forward passes), and gpufleet's per_device_batch beside them."""


def given(entries: Iterable[tuple[str | None, str, Any]]) -> dict[str, Any]:
    """The BATCH names among a layer's (section, key, value) entries (not script:'s, a launch recipe's own)."""
    return {key: value for section, key, value in entries if key in BATCH and section != "script"}


def _count(value: Any) -> int | None:
    """A count >= 1 as a job file, a flag or the environment gives it; None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        number = int(str(value).strip()) if isinstance(value, str) else value
    except ValueError:
        return None
    return number if isinstance(number, int) and number >= 1 else None


def batch(key: str, values: Mapping[str, Any]) -> tuple[dict[str, int], str] | None:
    """gpufleet's train fields for TRL's batch names given together in one layer (`values`, from `given`):
    per_device_batch = per_device_train_batch_size x gradient_accumulation_steps (completions per optimizer
    step), micro_batch = per_device_train_batch_size (per forward pass), steps_per_generation = TRL's (forward
    passes; default: gradient_accumulation_steps) / gradient_accumulation_steps (optimizer steps); TRL's
    defaults (8, 1) where one is not given. Returns (fields to write, a note on them, or the fix when there
    are none); None when `key` is not one of TRL's batch names or a value is no count."""
    trl_units = key == "steps_per_generation" and "gradient_accumulation_steps" in values  # TRL's, beside
    if key not in BATCH[:2] and not trl_units:
        return None
    counts = {name: _count(v) for name, v in values.items()}
    if any(n is None for n in counts.values()):
        return None
    accumulation = counts.get("gradient_accumulation_steps", 1)
    mine = counts.get("per_device_batch")
    if "per_device_train_batch_size" not in counts and mine is not None:  # gpufleet's batch beside
        if mine % accumulation:
            divisors = ", ".join(str(d) for d in range(1, mine + 1) if mine % d == 0)
            why = f"train.per_device_batch {mine} is not {accumulation} equal micro-batches"
            return {}, f"set train.micro_batch to a divisor of {mine} ({divisors}): {why}"
        return {"train.micro_batch": mine // accumulation}, ""
    per_pass = counts.get("per_device_train_batch_size", 8)
    out = {"train.per_device_batch": per_pass * accumulation}
    if accumulation > 1:
        out["train.micro_batch"] = per_pass
    passes = counts.get("steps_per_generation", accumulation)
    if passes % accumulation == 0:
        if passes != accumulation or "steps_per_generation" in counts:
            out["train.steps_per_generation"] = passes // accumulation
        return out, ""
    low = max(1, passes // accumulation)
    out["train.steps_per_generation"] = low
    other = f" or {low + 1}" if passes > accumulation else ""
    trls = f"{low * accumulation}{f' or {(low + 1) * accumulation}' if other else ''}"
    return out, (
        f"steps_per_generation {low}{other}, i.e. TRL's {trls}: TRL's {passes} is not a multiple of "
        f"gradient_accumulation_steps {accumulation}, and gpufleet generates for whole optimizer steps"
    )


def value(path: str, given: Any, fields: Mapping[str, Any]) -> tuple[Any, str] | None:
    """A value gpufleet's field `path` refuses that is TRL's for the option of the same name: (gpufleet's value,
    why: what TRL means by it), the job's other fields of that section (set or default) in `fields`; None when
    it is no such value. TRL 1.16's scale_rewards takes true (group) and false (none); transformers'
    warmup_steps below 1 is a fraction of the run (math.ceil(fraction x max_steps)), and truncates one above."""
    if path == "algorithm.scale_rewards":
        on = as_bool(given)
        if on is None:
            return None
        mine = "group" if on else "none"
        return (
            mine,
            f"TRL's scale_rewards {str(given).lower()} means {mine}; gpufleet names the choice (group, batch, none)",
        )
    if path != "train.warmup_steps" or isinstance(given, bool):
        return None
    try:
        number, steps = float(given), int(fields["max_steps"])
    except (KeyError, TypeError, ValueError):
        return None
    if not math.isfinite(number):  # nan, inf: the field's own one-line value error says it
        return None
    if number >= 1:
        return int(
            number
        ), f"TRL reads warmup_steps {given} as {int(number)} steps; gpufleet's takes whole steps"
    if number <= 0:
        return None
    count = math.ceil(number * steps)
    return count, (
        f"TRL reads warmup_steps {given} as a fraction of the run ({given} x train.max_steps {steps} = {count} "
        "steps); gpufleet's counts steps"
    )
