"""The memory rule: every device must hold what the plan puts on it (see gpufleet.plan)."""

from __future__ import annotations

from gpufleet.rules.registry import Context, rule


@rule
def fits_in_memory(ctx: Context):
    from gpufleet.plan.fit_rule import fit_problems

    return fit_problems(ctx)
