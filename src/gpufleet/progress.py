"""For a script that `gpufleet launch --scaling` measures: report how many samples have been processed.

    from gpufleet.progress import report
    report(samples_so_far)            # on rank 0, e.g. after each optimizer step: step x effective batch

It prints one line, `gpufleet-progress samples=<n>`, which the launcher timestamps as it arrives (any
other line format works too: set `script.progress_regex`). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import sys


def report(samples: int) -> None:
    """Print the cumulative number of samples processed over all ranks (call it on rank 0)."""
    print(f"gpufleet-progress samples={int(samples)}", file=sys.stdout, flush=True)
