"""Rules of the `monitor:` section: a sink switched on has its package installed."""

from __future__ import annotations

from gpufleet.rules.registry import Context, err, rule


@rule
def sinks_installed(ctx: Context):
    from gpufleet.monitor.sinks import EXTRA, missing

    for field in missing(ctx.job):
        yield err(
            [ctx.ref(f"monitor.{field}")],
            f"monitor.{field} is on but the {EXTRA[field]} package is not installed.",
            f"pip install 'gpufleet[{field}]' (or --set monitor.{field}=false)",
        )
