"""A training recipe moved from the device count it was tuned on to another: per-device batch, gradient
accumulation, learning rate and steps (pure arithmetic, no torch; `gpufleet launch` uses it).

keep_effective_batch: per_device_batch x accumulation x devices stays the recipe's. The per-device batch
stays as large as the reference's (it fitted in memory) or gets smaller; accumulation makes up the rest.
keep_per_device_batch: every device keeps the reference's batch and accumulation; the effective batch
grows with the devices, the learning rate follows `lr_rule`, and max_steps shrinks so the run sees the
same number of samples.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

from gpufleet.config.schema import ScriptSection
from gpufleet.errors import UserError


@dataclass(frozen=True)
class Recipe:
    devices: int
    per_device_batch: int | None
    grad_accum: int
    learning_rate: float | None
    max_steps: int | None

    @property
    def effective_batch(self) -> int | None:
        if self.per_device_batch is None:
            return None
        return self.per_device_batch * self.grad_accum * self.devices


def reference(s: ScriptSection) -> Recipe:
    return Recipe(
        s.reference_devices, s.per_device_batch, s.gradient_accumulation_steps, s.learning_rate, s.max_steps
    )


def split_batch(effective: int, devices: int, cap: int) -> tuple[int, int] | None:
    """(per_device_batch, accumulation) with the largest per-device batch <= cap, or None."""
    for accum in range(1, effective + 1):
        if effective % (devices * accum) == 0 and effective // (devices * accum) <= cap:
            return effective // (devices * accum), accum
    return None


def scaled(s: ScriptSection, devices: int) -> Recipe:
    """The recipe for `devices` devices (UserError when the rule cannot be kept exactly)."""
    ref = reference(s)
    if ref.per_device_batch is None:
        return Recipe(devices, None, ref.grad_accum, ref.learning_rate, ref.max_steps)
    if s.batch_rule == "keep_per_device_batch":
        now = Recipe(devices, ref.per_device_batch, ref.grad_accum, None, None)
    else:
        split = split_batch(ref.effective_batch, devices, ref.per_device_batch)
        if split is None:
            raise UserError(
                _indivisible(ref, devices), field="script.per_device_batch", fix=_nearest(ref, devices)
            )
        now = Recipe(devices, split[0], split[1], None, None)
    ratio = now.effective_batch / ref.effective_batch
    lr = ref.learning_rate
    if lr is not None:
        lr = {"none": lr, "linear": lr * ratio, "sqrt": lr * math.sqrt(ratio)}[s.lr_rule]
    steps = None if ref.max_steps is None else max(1, math.ceil(ref.max_steps / ratio))
    return Recipe(devices, now.per_device_batch, now.grad_accum, lr, steps)


def halved(ref: Recipe, now: Recipe) -> str | None:
    """The flags that halve the per-device batch of `now` and keep the reference's effective batch with more
    accumulation (`--set script.per_device_batch=4 --set script.gradient_accumulation_steps=4`); None when
    the batch is 1 or not known."""
    if not now.per_device_batch or now.per_device_batch < 2 or not ref.effective_batch:
        return None
    pdb = now.per_device_batch // 2  # a reference recipe that scales to half the per-device batch
    acc = max(1, ref.effective_batch // (pdb * ref.devices))
    return f"--set script.per_device_batch={pdb} --set script.gradient_accumulation_steps={acc}"


def _indivisible(ref: Recipe, devices: int) -> str:
    return (
        f"the reference effective batch {ref.effective_batch} (= {ref.per_device_batch} per device x "
        f"{ref.grad_accum} accumulation x {ref.devices} device{'s' * (ref.devices != 1)}) cannot be split "
        f"evenly over {devices} devices."
    )


def _nearest(ref: Recipe, devices: int) -> str:
    eff = ref.effective_batch
    lower, upper = eff - eff % devices, eff - eff % devices + devices
    counts = [n for n in range(1, 17) if split_batch(eff, n, ref.per_device_batch)]
    options = [f"an effective batch of {b}" for b in (lower, upper) if b > 0]
    return (
        f"use {' or '.join(options)} on {devices} devices (change script.per_device_batch or "
        f"script.gradient_accumulation_steps), or launch on {', '.join(map(str, counts))} devices, or set "
        "script.batch_rule=keep_per_device_batch"
    )


def table(ref: Recipe, now: Recipe) -> str:
    """Reference vs now, one row per quantity."""

    def fmt(v) -> str:
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    rows = [
        ("devices", ref.devices, now.devices),
        ("per-device batch", ref.per_device_batch, now.per_device_batch),
        ("gradient accumulation", ref.grad_accum, now.grad_accum),
        ("effective batch", ref.effective_batch, now.effective_batch),
        ("learning rate", ref.learning_rate, now.learning_rate),
        ("max steps", ref.max_steps, now.max_steps),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"  {'':{w}}  {'reference':>10}  {'now':>10}"]
    lines += [f"  {name:{w}}  {fmt(a):>10}  {fmt(b):>10}" for name, a, b in rows]
    return "\n".join(lines)


def values(now: Recipe, nproc: int, output_dir: str) -> dict[str, str]:
    """What the placeholders and GPUFLEET_* variables stand for (only the ones the recipe defines)."""
    out = {"nproc": str(nproc), "world_size": str(now.devices), "output_dir": output_dir}
    out["gradient_accumulation_steps"] = str(now.grad_accum)
    for name, v in (
        ("per_device_batch", now.per_device_batch),
        ("effective_batch", now.effective_batch),
        ("learning_rate", now.learning_rate),
        ("max_steps", now.max_steps),
    ):
        if v is not None:
            out[name] = f"{v:.6g}" if isinstance(v, float) else str(v)
    return out


def fill(command: list[str], known: dict[str, str]) -> list[str]:
    """The command with its {placeholders} replaced; an unknown or undefined one is a UserError."""
    out = []
    for arg in command:
        for _, name, _, _ in string.Formatter().parse(arg) if "{" in arg else ():
            if name is not None and name not in known:
                why = (
                    "is not set in this job (set the script.* field it comes from)"
                    if name in ("per_device_batch", "effective_batch", "learning_rate", "max_steps")
                    else "is not a placeholder gpufleet knows"
                )
                raise UserError(
                    f"{{{name}}} in {arg!r} {why}.",
                    field="script.command",
                    fix="placeholders: "
                    + ", ".join("{" + k + "}" for k in sorted(known))
                    + " ({{ for a brace)",
                )
        out.append(arg.format(**known) if "{" in arg or "}" in arg else arg)
    return out
