"""Hardware specs and NVML discovery behind a seam fed with recorded answers."""

from __future__ import annotations

import ctypes

import pytest

from fake_nvml import RTX4090, FakeNVML, Gpu, MiB, a100_node, workstation
from gpufleet.devicestate import GpuProcess
from gpufleet.errors import UserError
from gpufleet.hardware import GiB, detect, parse_gpu_spec, resolve_hardware, visible_order


def test_specs():
    hw = parse_gpu_spec("4x24GB")
    assert len(hw.devices) == 4 and hw.devices[3].total_bytes == 24 * GiB and hw.devices[0].bf16 is None
    hw = parse_gpu_spec("2xA100-80GB")
    assert hw.devices[1].name == "A100" and hw.devices[1].bf16 and hw.devices[1].total_gib == 80
    hw = parse_gpu_spec("2xV100")
    assert hw.devices[0].bf16 is False and hw.devices[0].total_gib == 32
    hw = parse_gpu_spec("1:16GB,0:24GB,2:RTX4090")
    assert [d.total_gib for d in hw.devices] == [24, 16, 24] and hw.devices[2].bf16
    assert parse_gpu_spec("cpu").is_cpu and resolve_hardware("cpu").is_cpu


@pytest.mark.parametrize(
    "spec", ["", "x24GB", "0x24GB", "3xfoo", "0:24GB,0:16GB", "1:24GB", "2x1MB", "a:24GB"]
)
def test_bad_specs(spec):
    with pytest.raises(UserError):
        parse_gpu_spec(spec)


def v100_box() -> FakeNVML:
    """Two RTX 4090 and a V100 (no bf16): CUDA_VISIBLE_DEVICES decides which the job sees."""
    return FakeNVML(
        [
            Gpu("NVIDIA GeForce RTX 4090", RTX4090, (8, 9)),
            Gpu("NVIDIA GeForce RTX 4090", RTX4090, (8, 9)),
            Gpu("Tesla V100-SXM2-32GB", 32 * GiB, (7, 0)),
        ]
    )


def test_detect_all():
    nvml = v100_box()
    hw = detect({}, nvml)
    assert [d.name for d in hw.devices] == [g.name for g in nvml.gpus]
    assert [d.bf16 for d in hw.devices] == [True, True, False]
    assert hw.devices[2].total_gib == 32 and hw.devices[0].free_bytes == RTX4090 - 430 * MiB
    assert nvml.shutdown == 1 and hw.origin == "detected"


def test_cuda_visible_devices_order():
    hw = detect({"CUDA_VISIBLE_DEVICES": "2,0"}, v100_box())
    assert [d.index for d in hw.devices] == [0, 1]
    assert [d.physical for d in hw.devices] == ["2", "0"] and hw.devices[0].visible_id == "2"
    assert hw.devices[0].bf16 is False  # logical 0 is the V100
    hw = detect({"CUDA_VISIBLE_DEVICES": "GPU-1f3c"}, v100_box())
    assert [d.physical for d in hw.devices] == ["1"]
    assert detect({"CUDA_VISIBLE_DEVICES": ""}, v100_box()).is_cpu
    assert visible_order({"CUDA_VISIBLE_DEVICES": "1,7,0"}, 3, []) == [1]  # CUDA stops at the first bad id


def test_failed_queries_are_unknown_not_fatal():
    hw = detect({}, FakeNVML(v100_box().gpus, fail={("cc", 0), ("mem", 1), ("name", 2), ("procs", 0)}))
    assert hw.devices[0].bf16 is None and hw.devices[1].total_bytes == 0 and hw.devices[2].name == "GPU"
    assert hw.devices[0].processes == ()


def test_no_driver_is_cpu():
    assert detect({}, workstation(init_fails=True)).is_cpu


def test_processes_and_p2p_as_nvml_reports_them():
    """Other processes (pid, bytes; None where NVML cannot say) and P2P per pair, in logical order."""
    hw = detect({}, workstation(busy={1: [(4145, 9 * GiB), (4188, None)]}))
    assert hw.devices[1].processes == (GpuProcess(4145, 9 * GiB), GpuProcess(4188, None))
    assert hw.devices[1].free_bytes == RTX4090 - 430 * MiB - 9 * GiB and hw.devices[0].processes == ()
    by_pair = {(x.a, x.b): x for x in hw.links}
    assert sorted(by_pair) == [(0, 1), (0, 2), (1, 2)]
    assert by_pair[(0, 1)].p2p is False and by_pair[(0, 1)].status == "the chipset does not support it"
    assert (
        by_pair[(0, 1)].path == "at a CPU's PCIe host bridge" and by_pair[(1, 2)].path == "across CPU sockets"
    )
    assert all(x.p2p for x in detect({}, a100_node()).links)
    hw = detect({"CUDA_VISIBLE_DEVICES": "2,1"}, workstation())  # renumbered: logical 0 = A6000, 1 = a 4090
    assert [(x.a, x.b, x.path) for x in hw.links] == [(0, 1, "across CPU sockets")]


def test_p2p_unknown_when_nvml_cannot_say():
    hw = detect({}, workstation(fail={("p2p", 0), ("p2p", 1), ("p2p", 2)}))
    assert [x.p2p for x in hw.links] == [None, None, None] and "unknown" in hw.links[0].status
    hw = detect({}, workstation(fail={("p2p", 0)}))  # 0 -> 1 not answered, 1 -> 0 "chipset not supported"
    assert [x.p2p for x in hw.links] == [False, False, False]


def test_the_p2p_index_is_passed_as_nvml_takes_it():
    """nvidia-ml-py's NVML_P2P_CAPS_INDEX_READ is the tuple (0,); the fake refuses it as ctypes does."""
    nvml = workstation()
    with pytest.raises(ctypes.ArgumentError):
        nvml.nvmlDeviceGetP2PStatus(
            *(nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1)), nvml.NVML_P2P_CAPS_INDEX_READ
        )
    assert detect({}, nvml).links[0].p2p is False  # detect unwraps it: an answer, not "unknown"


def test_check_uses_visible_devices(tmp_path, capsys, monkeypatch):
    import gpufleet.hardware as hardware
    from helpers import run_cli

    monkeypatch.setattr(hardware, "_load_nvml", v100_box)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(
        "train: {precision: bf16, per_device_batch: 4}\nalgorithm: {num_generations: 4}\n"
        "rollout: {max_prompt_length: 16, max_completion_length: 16}\n"
    )
    code, out = run_cli(capsys, ["check", "job.yaml"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert code == 0, out
    code, out = run_cli(capsys, ["check", "job.yaml"], {"CUDA_VISIBLE_DEVICES": "0,2"})
    assert code == 2 and "device 1 (Tesla V100-SXM2-32GB" in out


def test_host_ram_in_a_what_if_spec():
    """`,host=SIZE` states a node's host RAM; without it a GPU spec's host is assumed to have twice its
    GPUs' memory (a CPU spec keeps this machine's)."""
    from gpufleet.hardware import parse_gpu_spec

    stated = parse_gpu_spec("4x24GB,host=256GB")
    assert (len(stated.devices), stated.ram_bytes, stated.ram_source) == (4, 256 * 1024**3, "stated")
    assert parse_gpu_spec("0:24GB,host=1T,1:16GB").ram_bytes == 1024**4
    assumed = parse_gpu_spec("2x24GB")
    assert (assumed.ram_bytes, assumed.ram_source) == (2 * 2 * 24 * 1024**3, "assumed")
    assert parse_gpu_spec("cpu").ram_source == "this machine"
    for bad in ("4x24GB,host=lots", "4x24GB,host=1T,host=2T"):
        with pytest.raises(UserError, match="host RAM size"):
            parse_gpu_spec(bad)
