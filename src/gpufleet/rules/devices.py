"""Rules about the GPUs as NVML sees them now (detected hardware only): other processes already on the
devices the job takes. Whether their free memory holds the job is the fit rule's (gpufleet.plan.fit_rule),
which knows the plan's bytes per device. Registered with `gpufleet.rules.registry.rule`.
"""

from __future__ import annotations

from gpufleet import preflight
from gpufleet.rules.registry import Context, rule


@rule
def devices_busy(ctx: Context):
    """A warning for each device of the job that other processes already use."""
    if ctx.hw.is_cpu or not ctx.hw.is_detected:
        return []
    return preflight.busy(ctx.hw, ctx.topo.devices, [ctx.ref("placement.devices")])
