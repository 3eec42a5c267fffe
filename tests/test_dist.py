"""dist.init: one call for `python` and `torchrun` alike; the resume decision the launcher makes once."""

from __future__ import annotations

import pytest

from gpufleet import dist
from gpufleet.errors import UserError
from gpufleet.rl import resume
from gpufleet.topology import Topology

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK")


def test_one_process_without_torchrun_env_is_rank_0_of_1(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    rt = dist.init(Topology(1, (0,), (), cpu=True), cpu=True)
    assert (rt.rank, rt.world_size, rt.policy_ranks, rt.role, rt.device.type) == (0, 1, [0], "policy", "cpu")
    assert not rt.distributed and rt.policy_group is None and rt.scorers == []


def test_world_that_does_not_match_the_layout_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(UserError, match="needs 3 processes"):
        dist.init(Topology(1, (0, 1), ((2, ("reference",)),), cpu=True), cpu=True)


def test_fresh_run_directory_starts_at_step_0(tmp_path, monkeypatch):
    from gpufleet.config.load import load_job

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    job = load_job(None, [f"output.dir={tmp_path}"], env={}).job
    assert resume.decide(job, tmp_path, 8) == resume.Start()
    assert resume.worker_start(job, tmp_path) == resume.Start()
