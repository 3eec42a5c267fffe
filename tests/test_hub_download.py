"""A hub model that is not in the local cache and cannot be downloaded: `check` warns, `train` stops at
once with one line naming model.path and the fix (not after huggingface_hub's ~50 s of retries, and
not with a fix about saving a tokenizer)."""

from __future__ import annotations

import socket

from gpufleet.models.info import hub_download_problem
from helpers import run_user

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"  # in gpufleet's table of known models: check knows its shape


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_download_problem(tmp_path):
    cache = tmp_path / "hub"
    closed = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    why = hub_download_problem(HUB_ID, closed)
    assert why and "not in the local Hugging Face cache" in why and "cannot be reached" in why
    offline = hub_download_problem(HUB_ID, {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert offline and "HF_HUB_OFFLINE is set" in offline
    # cached (a snapshot with config.json), a local folder, a built-in name: nothing to download
    snap = cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert hub_download_problem(HUB_ID, closed) is None
    assert hub_download_problem(str(tmp_path), closed) is None
    assert hub_download_problem("builtin:tiny-qwen2", closed) is None
    with socket.socket() as server:  # a reachable endpoint: the hub is up, the download may go ahead
        server.bind(("127.0.0.1", 0))
        server.listen()
        up = {
            "HF_HUB_CACHE": str(tmp_path / "empty"),
            "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
        }
        assert hub_download_problem(HUB_ID, up) is None


def test_train_stops_at_once_with_the_fix(tmp_path):
    (tmp_path / "job.yaml").write_text(
        f"model:\n  path: {HUB_ID}\ndata:\n  path: builtin:repeat\n"
        "train:\n  max_steps: 2\n  per_device_batch: 8\nalgorithm:\n  num_generations: 4\n"
        "rollout:\n  max_completion_length: 8\n"
    )
    env = {
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
    }
    check = run_user("check", "job.yaml", cwd=tmp_path, env_extra=env, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{HUB_ID} is not in the local Hugging Face cache" in check.stdout + check.stderr
    assert f"hf download {HUB_ID}" in check.stdout + check.stderr
    r = run_user("train", "job.yaml", cwd=tmp_path, env_extra=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("gpufleet: error:")]
    assert "model.path:" in line and "cannot be reached" in line and f"hf download {HUB_ID}" in line
    assert "tokenizer.save_pretrained" not in line and "Traceback" not in r.stderr
    assert not (tmp_path / "runs" / "default" / "final").exists()
