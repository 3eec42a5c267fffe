"""`gpufleet launch` diagnoses NCCL failures and collective timeouts (issue 10 item 3). There is no NCCL
on a CPU machine, so the NCCL scripts raise torch's own DistBackendError with the text NCCL and torch
print on real hardware (copied from real reports, cited below) after NCCL's own WARN line. A collective
timeout happens for real with gloo on the CPU (one rank late past a 3 s timeout); NCCL's watchdog is its
real lines, then an abort as torch does."""

from __future__ import annotations

import pytest

from test_launch_script import folder, launch_broken

# NCCL's WARN line and torch's error on two GeForce cards without peer-to-peer: the WARN line as NCCL
# printed it in ray-project/ray_lightning#24; torch 2.x's DistBackendError text as in NVIDIA/nccl#1410.
P2P = """
import os, sys, time, torch.distributed as dist
if os.environ["RANK"] == "1":
    print("z-pc:909608:910337 [0] transport/p2p.cc:238 NCCL WARN failed to open CUDA IPC handle : 217 "
          "peer access is not supported between these two devices", file=sys.stderr, flush=True)
    raise dist.DistBackendError(
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error (run with "
        "NCCL_DEBUG=INFO for details), NCCL version 2.20.5\\nncclUnhandledCudaError: Call to CUDA function "
        "failed.\\nLast error:\\nCuda failure 217 'peer access is not supported between these two devices'")
time.sleep(120)  # rank 0 waits in its collective until torchrun stops it
"""

# Two nodes that cannot open a connection: torch 2.x's text as in NVIDIA/nccl#1381 and zai-org/CogVLM2#178.
SYSTEM = """
import os, time, torch.distributed as dist
if os.environ["RANK"] == "1":
    raise dist.DistBackendError(
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, unhandled system error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\\nncclSystemError: System call (e.g. "
        "socket, malloc) or external library call failed or device error.")
time.sleep(120)
"""

TIMEOUT = """
import datetime, os, time, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
if dist.get_rank() == 1:
    print("rank 1 loading a slow shard", flush=True)
    time.sleep(120)
dist.barrier()
"""

# NCCL's watchdog on the rank that waited (torch 2.x's lines as in hiyouga/LlamaFactory#7396); it then
# aborts the process, as torch does. Rank 1 is busy elsewhere.
WATCHDOG = """
import os, pathlib, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 saving a checkpoint", flush=True)
    pathlib.Path("rank1-busy").touch()
    time.sleep(120)
while not pathlib.Path("rank1-busy").exists():
    time.sleep(0.1)
print("[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation "
      "timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) "
      "ran for 600060 milliseconds before timing out.", file=sys.stderr, flush=True)
os.abort()
"""


def launch(tmp_path, script: str):
    return launch_broken(folder(tmp_path, broken=script))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, fix",
    [
        (
            P2P,
            "NCCL failed on peer-to-peer between the GPUs (consumer cards, or a PCIe topology without it). Fix: NCCL_P2P_DISABLE=1",
        ),
        (SYSTEM, "without InfiniBand set NCCL_IB_DISABLE=1"),
    ],
    ids=["p2p", "system"],
)
def test_nccl_failure_names_the_rank_and_the_fix(tmp_path, script, fix):
    p = launch(tmp_path, script)
    assert p.returncode == 1, p.stdout + p.stderr
    head = next(x for x in p.stderr.splitlines() if x.startswith("gpufleet: rank"))
    assert head.startswith("gpufleet: rank 1 failed first: NCCL failed"), head
    assert fix in head and "NCCL_DEBUG=INFO" in head
    assert "DistBackendError: NCCL error in" in p.stderr  # the last lines of rank 1's log follow


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, lagging, said",
    [
        (TIMEOUT, "rank 1 loading a slow shard", "Timed out waiting 3000ms for recv operation"),
        (WATCHDOG, "rank 1 saving a checkpoint", "Watchdog caught collective operation timeout"),
    ],
    ids=["gloo", "nccl-watchdog"],
)
def test_collective_timeout_names_the_lagging_rank(tmp_path, script, lagging, said):
    p = launch(tmp_path, script)
    assert p.returncode == 1, p.stdout + p.stderr
    head = next(x for x in p.stderr.splitlines() if x.startswith("gpufleet: rank"))
    assert head.startswith("gpufleet: rank 0 failed first: a collective timed out on rank 0"), head
    assert f"waiting for rank 1 (its last line: {lagging!r})" in head and "Fix:" in head
    assert said in p.stderr
