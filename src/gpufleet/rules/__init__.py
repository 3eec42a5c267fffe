"""Every rule a job must satisfy, checked before anything loads: `run_checks(resolved, hardware)`.

registry.py holds `Context`, `@rule` and `run_checks`; job.py the rules about the job's numbers;
resources.py those about paths, files and the user's code; storage.py those about where the run
writes (writable folders, disk space); fit.py the memory rule (gpufleet.plan);
devices.py those about the detected GPUs as they are now; env.py those of an env job (multi-turn agent RL);
chat.py those of chat episodes and tools; chatdata.py those of chat-format data rows; prompts.py the
length of a data file's prompts; trlenv.py those of a TRL environment class;
lora.py those of a LoRA job; offload.py those of placement.offload; algorithm.py those of the GRPO
family's options (TRL's warnings); rollout.py those of rollout ranks and generating ahead; monitor.py those of the monitor section; unused.py the fields
that have no effect in this job (env: without an env, script: in a trainer job).
Importing this package registers them all, in that order.
"""

# The order rules are registered in is the order check reports them in.
# isort: off
from gpufleet.rules import job  # noqa: F401
from gpufleet.rules import algorithm  # noqa: F401
from gpufleet.rules import rollout  # noqa: F401
from gpufleet.rules import fit  # noqa: F401
from gpufleet.rules import devices  # noqa: F401
from gpufleet.rules import resources  # noqa: F401
from gpufleet.rules import storage  # noqa: F401
from gpufleet.rules import env  # noqa: F401
from gpufleet.rules import chat  # noqa: F401
from gpufleet.rules import chatdata  # noqa: F401
from gpufleet.rules import prompts  # noqa: F401
from gpufleet.rules import trlenv  # noqa: F401
from gpufleet.rules import lora  # noqa: F401
from gpufleet.rules import offload  # noqa: F401
from gpufleet.rules import monitor  # noqa: F401
from gpufleet.rules import unused  # noqa: F401

# isort: on
from gpufleet.rules.registry import Context, run_checks

__all__ = ["Context", "run_checks"]
