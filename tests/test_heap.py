"""engine/heap.py: freed memory stays with the process, so a step's second round of tensors takes no page
faults (measured in a fresh process each, with getrusage; two rounds after the first)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

ROUNDS = """
import resource
import numpy as np  # its arrays come from glibc's malloc, as torch's CPU tensors do (no torch import: quick)
from gpufleet.engine.heap import keep_freed_memory
print(keep_freed_memory())
def round_():  # 40 live arrays of 2 MiB, written, then all freed (a step's activations)
    live = [np.ones(512 * 1024, dtype=np.float32) for _ in range(40)]
    del live
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(keep: bool) -> tuple[str, int]:
    env = {**os.environ, "GPUFLEET_KEEP_FREED": "1" if keep else "0"}
    out = subprocess.run([sys.executable, "-c", ROUNDS], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept, int(faults)


def test_a_second_round_of_tensors_reuses_the_pages_of_the_first():
    kept, faults = _second_round_faults(keep=True)
    assert kept == "True" and faults < 8_000, faults  # 2 x 80 MiB again: 40,960 pages if they were new


def test_without_it_glibc_hands_the_pages_back_and_faults_them_in_again():
    kept, faults = _second_round_faults(keep=False)
    assert kept == "False" and faults > 20_000, faults  # (glibc adapts after a few rounds of one size)
