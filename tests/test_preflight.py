"""Preflight on detected GPUs (issue 10 item 1), with NVML's answers recorded in tests/fake_nvml.py: free
memory short of what is asked, GPUs busy with other processes, no P2P between the chosen GPUs — for
`gpufleet launch --dry-run`, `gpufleet check` of a launch job and of a `train` job, and a real launch
whose ranks get NCCL_P2P_DISABLE=1."""

from __future__ import annotations

import pytest

import fake_nvml
import gpufleet.hardware as hardware
from gpufleet import preflight
from gpufleet.hardware import GiB, detect, parse_gpu_spec
from helpers import run_cli

JOB = """
script:
  command: python train.py --bs {per_device_batch}
  per_device_batch: 8
  memory_per_device: 20GB
output: {dir: run}
"""
BUSY = {1: [(4145, 9 * GiB), (4188, None)]}  # an RTX 4090 someone else uses: 14.6 GiB free


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "train.py").write_text("import os\nprint('P2P', os.environ.get('NCCL_P2P_DISABLE'))\n")
    return tmp_path


def machine(monkeypatch, nvml) -> None:
    monkeypatch.setattr(hardware, "_load_nvml", lambda: nvml)


def test_short_of_free_memory_names_the_device_and_the_fix(home, capsys, monkeypatch):
    machine(monkeypatch, fake_nvml.workstation(busy=BUSY))
    code, out = run_cli(capsys, ["launch", "job.yaml", "--nproc", "2", "--dry-run"])
    assert code == 2 and "Nothing was started" in out, out
    line = next(x for x in out.splitlines() if x.startswith("error:"))
    assert "script.memory_per_device = 20GB (job.yaml:5)" in line
    assert "device 1 (NVIDIA GeForce RTX 4090) has 14.6 GiB free of 24.0 GiB" in line
    assert "in use by pid 4145 (9.0 GiB), pid 4188 (memory not reported)" in line
    assert "needs 20.0 GiB" in line and "CUDA_VISIBLE_DEVICES=0,2" in line  # the idle 4090 and the A6000
    assert "--set script.per_device_batch=2 --set script.gradient_accumulation_steps=4" in line
    assert "device 0" not in line  # the idle 4090 has room
    code, same = run_cli(capsys, ["check", "job.yaml", "--set", "launch.nproc_per_node=2"])
    assert code == 2 and line in same  # gpufleet check of a launch job says the same


def test_busy_gpus_warn_with_the_processes(home, capsys, monkeypatch):
    machine(monkeypatch, fake_nvml.workstation(busy=BUSY))
    code, out = run_cli(
        capsys, ["launch", "job.yaml", "--nproc", "2", "--dry-run", "--set", "script.memory_per_device=8GB"]
    )
    assert code == 0, out
    warn = [x for x in out.splitlines() if x.startswith("warning: device 1")]
    assert len(warn) == 1 and "already used by 2 other processes: pid 4145 (9.0 GiB)" in warn[0]
    assert "run on idle devices: CUDA_VISIBLE_DEVICES=0,2" in warn[0]


def test_no_p2p_sets_nccl_p2p_disable_and_says_so(home, capsys, monkeypatch):
    machine(monkeypatch, fake_nvml.workstation())
    code, out = run_cli(capsys, ["launch", "job.yaml", "--nproc", "2", "--dry-run"])
    assert code == 0, out
    said = [x for x in out.splitlines() if "NCCL_P2P_DISABLE=1 for the ranks" in x]
    assert len(said) == 1 and "GPUs 0-1" in said[0] and "the chipset does not support it" in said[0]
    assert "at a CPU's PCIe host bridge" in said[0]
    assert "NCCL_P2P_DISABLE=1" in next(x for x in out.splitlines() if x.startswith("  env:"))
    # the user's own setting stands, and NVLink machines need nothing
    code, out = run_cli(
        capsys, ["launch", "job.yaml", "--nproc", "2", "--dry-run"], {"NCCL_P2P_DISABLE": "0"}
    )
    assert code == 0 and "NCCL_P2P_DISABLE" not in out, out
    machine(monkeypatch, fake_nvml.a100_node())
    code, out = run_cli(capsys, ["launch", "job.yaml", "--nproc", "2", "--dry-run"])
    assert code == 0 and "NCCL_P2P_DISABLE" not in out, out


@pytest.mark.slow
def test_the_ranks_get_nccl_p2p_disable(home, capfd, monkeypatch):
    """A real launch on the CPU (the ranks run the script; NVML says two 4090s without P2P): every rank's
    environment has NCCL_P2P_DISABLE=1."""
    machine(monkeypatch, fake_nvml.workstation())
    code, out = run_cli(
        capfd, ["launch", "job.yaml", "--nproc", "2", "--set", "script.memory_per_device=8GB"]
    )
    assert code == 0, out
    assert "gpufleet sets NCCL_P2P_DISABLE=1" in out and "P2P 1" in out
    assert "P2P 1" in (home / "run" / "logs" / "rank1.log").read_text()


def test_what_if_hardware_is_checked_against_its_size(home, capsys):
    code, out = run_cli(capsys, ["launch", "job.yaml", "--gpus", "2x16GB", "--dry-run"])
    assert code == 2 and "device 0 (16GB GPU) has 16.0 GiB, but the job needs 20.0 GiB" in out, out
    code, out = run_cli(capsys, ["launch", "job.yaml", "--gpus", "2x24GB", "--dry-run"])
    assert code == 0 and "error" not in out, out


def test_a_bad_size_is_one_line_with_the_fix(home, capsys):
    code, out = run_cli(
        capsys, ["launch", "job.yaml", "--dry-run", "--set", "script.memory_per_device=20 gigs"]
    )
    assert code == 2 and "not a size such as 20GB" in out and "Traceback" not in out, out


def test_preflight_functions_by_hand():
    hw = detect({}, fake_nvml.workstation(busy={0: [(7, 20 * GiB)]}))
    assert preflight.room_elsewhere(hw, 2) == "CUDA_VISIBLE_DEVICES=1,2"
    assert preflight.room_elsewhere(hw, 1, 30 * GiB) == "CUDA_VISIBLE_DEVICES=2"  # only the A6000 has 30 GiB
    assert preflight.room_elsewhere(hw, 3) is None
    assert preflight.p2p_env(hw, [0, 2], {})[0] == {"NCCL_P2P_DISABLE": "1"}
    assert preflight.p2p_env(hw, [0], {}) == ({}, None)  # one GPU: nothing to reach
    assert preflight.p2p_env(parse_gpu_spec("2x24GB"), [0, 1], {}) == ({}, None)  # a what-if: unknown
    hw = detect({"CUDA_VISIBLE_DEVICES": "2,0"}, fake_nvml.workstation(busy={0: [(7, 20 * GiB)]}))
    assert preflight.room_elsewhere(hw, 1, 30 * GiB) == "CUDA_VISIBLE_DEVICES=2"  # physical ids


TRAIN = "train: {per_device_batch: 4}\nalgorithm: {num_generations: 4}\nrollout: {max_prompt_length: 16, max_completion_length: 16}\n"


def test_train_job_checked_against_free_memory_and_busy_gpus(home, capsys, monkeypatch):
    """`gpufleet check` of a train job: the planner's bytes per device against NVML's free memory."""
    (home / "train.yaml").write_text(TRAIN)
    machine(monkeypatch, fake_nvml.workstation(busy={1: [(4145, 23 * GiB + 400 * 1024**2)]}))
    code, out = run_cli(capsys, ["check", "train.yaml", "--set", "launch.nproc_per_node=2"])
    assert code == 2, out
    assert (
        "device 1 (NVIDIA GeForce RTX 4090) has 0.2 GiB free of 24.0 GiB; in use by pid 4145 (23.4 GiB)"
        in out
    )
    assert "but the job needs" in out and "fix: --set placement.devices=0,2 (idle GPUs with room)" in out
    assert "is already used by 1 other process: pid 4145" in out
    assert "nccl: GPUs 0-1 have no peer-to-peer access" in out
    code, out = run_cli(
        capsys, ["check", "train.yaml", "--set", "launch.nproc_per_node=2", "--set", "placement.devices=0,2"]
    )
    assert code == 0 and "device 1" not in out, out


def test_train_gives_its_ranks_nccl_p2p_disable(home, capsys, monkeypatch):
    (home / "train.yaml").write_text(TRAIN)
    machine(monkeypatch, fake_nvml.workstation())
    code, out = run_cli(capsys, ["train", "train.yaml", "--set", "launch.nproc_per_node=2", "--print-launch"])
    assert code == 0, out
    assert sum("gpufleet sets NCCL_P2P_DISABLE=1" in x for x in out.splitlines()) == 1
    assert "NCCL_P2P_DISABLE=1 OMP_NUM_THREADS=" in out  # in the ranks' environment
    machine(monkeypatch, fake_nvml.a100_node())
    code, out = run_cli(capsys, ["train", "train.yaml", "--set", "launch.nproc_per_node=2", "--print-launch"])
    assert code == 0 and "NCCL_P2P_DISABLE" not in out, out
