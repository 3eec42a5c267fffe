"""Hardware specs and NVML discovery behind a seam fed with recorded answers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


class FakeNVML:
    """Recorded answers of pynvml for three GPUs; `fail` makes chosen queries raise."""

    def __init__(self, fail=(), init_fails=False):
        self.fail, self.init_fails = set(fail), init_fails
        self.names = ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB"]
        self.shutdown = 0

    def nvmlInit(self):
        if self.init_fails:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown += 1

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _maybe_fail(self, what, h):
        if (what, h) in self.fail:
            raise RuntimeError("Not Supported")

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}aaa-{h}"

    def nvmlDeviceGetName(self, h):
        self._maybe_fail("name", h)
        return self.names[h].encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        self._maybe_fail("mem", h)
        total = (24 if h < 2 else 32) * GiB
        return SimpleNamespace(total=total, free=total - GiB, used=GiB)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        self._maybe_fail("cc", h)
        return (8, 9) if h < 2 else (7, 0)


def test_detect_all():
    nvml = FakeNVML()
    hw = detect({}, nvml)
    assert [d.name for d in hw.devices] == nvml.names
    assert [d.bf16 for d in hw.devices] == [True, True, False]
    assert hw.devices[2].total_gib == 32 and hw.devices[0].free_bytes == 23 * GiB
    assert nvml.shutdown == 1 and hw.origin == "detected"


def test_cuda_visible_devices_order():
    hw = detect({"CUDA_VISIBLE_DEVICES": "2,0"}, FakeNVML())
    assert [d.index for d in hw.devices] == [0, 1]
    assert [d.physical for d in hw.devices] == ["2", "0"]
    assert hw.devices[0].bf16 is False  # logical 0 is the V100
    hw = detect({"CUDA_VISIBLE_DEVICES": "GPU-1aaa"}, FakeNVML())
    assert [d.physical for d in hw.devices] == ["1"]
    assert detect({"CUDA_VISIBLE_DEVICES": ""}, FakeNVML()).is_cpu
    assert visible_order({"CUDA_VISIBLE_DEVICES": "1,7,0"}, 3, []) == [1]  # CUDA stops at the first bad id


def test_failed_queries_are_unknown_not_fatal():
    hw = detect({}, FakeNVML(fail={("cc", 0), ("mem", 1), ("name", 2)}))
    assert hw.devices[0].bf16 is None and hw.devices[1].total_bytes == 0 and hw.devices[2].name == "GPU"


def test_no_driver_is_cpu():
    assert detect({}, FakeNVML(init_fails=True)).is_cpu


def test_check_uses_visible_devices(tmp_path, capsys, monkeypatch):
    import gpufleet.hardware as hardware
    from helpers import run_cli

    monkeypatch.setattr(hardware, "_load_nvml", lambda: FakeNVML())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(
        "train: {precision: bf16, per_device_batch: 4}\nalgorithm: {num_generations: 4}\n"
        "rollout: {max_prompt_length: 16, max_completion_length: 16}\n"
    )
    code, out = run_cli(capsys, ["check", "job.yaml"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert code == 0, out
    code, out = run_cli(capsys, ["check", "job.yaml"], {"CUDA_VISIBLE_DEVICES": "0,2"})
    assert code == 2 and "device 1 (Tesla V100-SXM2-32GB" in out
