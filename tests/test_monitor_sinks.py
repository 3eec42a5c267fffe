"""TensorBoard and W&B sinks: a real run with both on (W&B offline), its TensorBoard events read back
with TensorBoard's own reader and the offline W&B run file, both carrying metrics.jsonl's names and values;
a sink asked for but not installed is one line naming the field and the fix, exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import console_script, process_env, run_cli

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "examples" / "quickstart.yaml")


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_carry_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "sinks"
    argv = [console_script(), "train", QUICK, "--gpus", "cpu"]
    for s in (
        "train.max_steps=3",
        "train.per_device_batch=8",
        "monitor.tensorboard=true",
        "monitor.wandb=true",
        "monitor.wandb_mode=offline",
        f"output.dir={out}",
    ):
        argv += ["--set", s]
    env = process_env(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward", "kl", "step_time", "timing/generate", "timing/backward", "memory/peak_gib"} <= tags
    for key in ("reward", "timing/backward", "tokens_per_s"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([m[key] for m in metrics], rel=1e-6)
    logs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, list((out / "wandb").rglob("*"))[:20]
    history = wandb_history(logs[0])
    assert [int(h["_step"]) for h in history] == [1, 2, 3]
    for key in ("reward", "timing/generate", "memory/peak_gib"):
        assert [float(h[key]) for h in history] == pytest.approx([m[key] for m in metrics], rel=1e-9)


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file: a 7-byte header (":W&B", magic, version), then
    LevelDB log records (32 KiB blocks; each chunk: crc32, length, type FULL/FIRST/MIDDLE/LAST) holding
    wandb's own `Record` protobufs (wandb 0.31 no longer ships a Python reader)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunks, whole = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or kind == 0:
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            whole.append(chunks)
            chunks = b""
    rows = []
    for raw in whole:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return rows


def test_a_sink_not_installed_is_one_line(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    code, out = run_cli(capsys, ["check", QUICK, "--gpus", "cpu", "--set", "monitor.wandb=true"])
    assert code == 2
    assert "monitor.wandb is on but the wandb package is not installed." in out
    assert "pip install 'gpufleet[wandb]' (or --set monitor.wandb=false)" in out
