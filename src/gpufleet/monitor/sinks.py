"""Where a step's metrics go besides metrics.jsonl: TensorBoard (`monitor.tensorboard`) and Weights &
Biases (`monitor.wandb`), with the same names. Rank 0 only; both are optional dependencies, imported
here lazily; missing, they are a one-line error (`gpufleet check` says it before anything starts)."""

from __future__ import annotations

import math
from pathlib import Path

from gpufleet.errors import UserError

EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""monitor field -> the module it needs (and the gpufleet extra that installs it)."""


def missing(job) -> list[str]:
    """The monitor fields switched on whose package is not installed."""
    import importlib.util

    return [
        f for f, mod in EXTRA.items() if getattr(job.monitor, f) and importlib.util.find_spec(mod) is None
    ]


def _need(field: str) -> None:
    raise UserError(
        f"monitor.{field} is on but the {EXTRA[field]} package is not installed.",
        field=f"monitor.{field}",
        fix=f"pip install 'gpufleet[{field}]' (or --set monitor.{field}=false)",
    )


class Sinks:
    """The sinks a job asks for (none: writing does nothing)."""

    def __init__(self, job, out: Path):
        self.tb = self.wandb = None
        cfg = job.monitor
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                _need("tensorboard")
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                _need("wandb")
            try:
                self.wandb = wandb.init(
                    project=cfg.wandb_project,
                    name=out.name,
                    dir=str(out),
                    mode=cfg.wandb_mode,
                    config=job.model_dump(mode="json"),
                )
            except (wandb.errors.UsageError, wandb.errors.AuthenticationError, wandb.errors.CommError) as e:
                raise UserError(
                    f"W&B refused the run ({str(e).splitlines()[0] if str(e) else type(e).__name__}).",
                    field="monitor.wandb_mode",
                    fix="`wandb login` (or set WANDB_API_KEY), or --set monitor.wandb_mode=offline",
                ) from None

    def write(self, m: dict[str, float]) -> None:
        step = int(m["step"])
        scalars = {k: float(v) for k, v in m.items() if k != "step" and isinstance(v, int | float)}
        if self.tb is not None:
            for k, v in scalars.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
