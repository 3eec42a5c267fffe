"""Multi-node launches under Slurm (issue 10 item 2): the node count, node rank and rendezvous derived
from recorded SLURM_* variables (a table), their provenance in the resolved job, the allocation mistakes
named with their fix, and a real 2-"node" `gpufleet launch` on this machine from Slurm's variables alone."""

from __future__ import annotations

import subprocess

import pytest

from gpufleet.config.load import load_job
from gpufleet.launch.torchrun import free_port
from gpufleet.slurm import derive, expand_hostlist
from helpers import console_script, process_env

# What srun exports on the second node of `sbatch --nodes=3` + `srun --ntasks-per-node=1` (job 81234).
STEP = {
    "SLURM_JOB_ID": "81234",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NODELIST": "gpu[07-08,11]",
    "SLURM_NODELIST": "gpu[07-08,11]",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "gpu[07-08,11]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_GPUS_ON_NODE": "4",
}


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("node7", ["node7"]),
        ("a1,b[8-10]", ["a1", "b8", "b9", "b10"]),
        ("rack[1-2]-gpu[0-1]", ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("10.0.0.[5-6]", ["10.0.0.5", "10.0.0.6"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-", "gpu]1[", "gpu[a-b]", "gpu[[1]]", ""])
def test_unreadable_hostlists_raise(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


@pytest.mark.parametrize(
    "changes, nnodes, node_rank, endpoint",
    [
        ({}, 3, 1, "gpu07:29634"),  # this host's place in the step's list; port 29400 + 81234 % 1000
        ({"SLURMD_NODENAME": "elsewhere"}, 3, 1, "gpu07:29634"),  # not in the list: SLURM_NODEID
        ({"SLURMD_NODENAME": "gpu11", "SLURM_NODEID": "2"}, 3, 2, "gpu07:29634"),
        ({"MASTER_PORT": "29511"}, 3, 1, "gpu07:29511"),  # the user's port wins
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, 3, 1, "gpu07:29634"),  # SLURM_NODELIST
        (
            {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu[08,11]"},
            2,
            0,
            "gpu08:29634",
        ),
    ],
)
def test_derivation_table(changes, nnodes, node_rank, endpoint):
    env = {k: v for k, v in {**STEP, **changes}.items() if v is not None}
    got = derive(env, hostnames=lambda _: None)
    assert not got.findings
    assert {k: v for k, (v, _) in got.values.items()} == {
        "launch.nnodes": nnodes,
        "launch.node_rank": node_rank,
        "launch.rdzv_endpoint": endpoint,
    }


def test_nothing_outside_slurm_or_on_one_node():
    assert derive({}).values == {} and derive({}).findings == []
    one = {**STEP, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "gpu07"}
    assert derive(one).values == {}


def test_allocation_mistakes_are_named():
    many = derive({**STEP, "SLURM_STEP_NUM_TASKS": "12"})  # srun --ntasks-per-node=4: 4 torchruns per node
    assert many.values == {} and many.findings[0].severity == "error"
    assert "one task per node" in many.findings[0].why and "--ntasks-per-node=1" in many.findings[0].fix
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}  # the batch script itself
    outside = derive(batch)
    assert outside.values == {} and outside.findings[0].severity == "warning"
    assert "not in an srun step" in outside.findings[0].why
    odd = {**STEP, "SLURM_STEP_NODELIST": "gpu[07-08,1a]"}  # a list this parser cannot read: scontrol decides
    assert derive(odd, hostnames=lambda _: ["x1", "x2", "x3"]).values["launch.rdzv_endpoint"][0] == "x1:29634"
    assert derive(odd, hostnames=lambda _: None).findings[0].severity == "error"


def test_slurm_is_a_layer_with_provenance_below_env_and_flags(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("launch: {nnodes: 1}\n")
    r = load_job(job, [], STEP)
    assert (r.job.launch.nnodes, r.job.launch.node_rank) == (3, 1)
    assert str(r.source("launch.node_rank")) == "slurm SLURMD_NODENAME=gpu08 in SLURM_STEP_NODELIST"
    r = load_job(job, ["launch.rdzv_endpoint=head:1234"], {**STEP, "GPUFLEET_LAUNCH__NODE_RANK": "2"})
    assert (r.job.launch.node_rank, r.job.launch.rdzv_endpoint) == (2, "head:1234")
    r = load_job(job, [], {**STEP, "SLURM_STEP_NUM_TASKS": "12"})
    assert [p.field for p in r.problems] == ["SLURM_STEP_NUM_TASKS"] and r.job.launch.nnodes == 1


@pytest.mark.slow
def test_two_nodes_from_slurm_variables_alone(tmp_path):
    """Two `gpufleet launch` agents on this machine, each given only what srun would export on its node:
    they meet at the derived rendezvous and run a DDP script as one world of 2."""
    from test_launch_script import DDP, JOB

    home = tmp_path / "me"
    home.mkdir()
    (home / "job.yaml").write_text(JOB)
    (home / "train.py").write_text(DDP)
    step = {**STEP, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2"}
    step.update(SLURM_STEP_NODELIST="127.0.0.1,localhost", MASTER_PORT=str(free_port()))
    step.pop("SLURMD_NODENAME")
    argv = [console_script(), "launch", "job.yaml", "--gpus", "cpu", "--nproc", "1"]
    nodes = [
        subprocess.Popen(
            argv,
            cwd=home,
            env=process_env(**{**step, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in nodes]
    for p, (out, err) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, out + err
        assert "1 process per node x 2 nodes" in out and "rendezvous 127.0.0.1:" in out
    assert "python train.py --bs 4 --lr 0.01" in outs[0][0]  # effective batch 8 over a world of 2
    logs = home / "run" / "logs"
    assert "replicas equal" in (logs / "rank1.log").read_text()
    assert "rank 0 bs 4" in outs[0][0] + outs[1][0]  # c10d gives rank 0 to either node's agent
    assert (logs / "torchrun.node0.log").exists() and (logs / "torchrun.node1.log").exists()


@pytest.mark.parametrize(
    "sbatch, verb", [("slurm.sbatch", "train"), ("launch/slurm-launch.sbatch", "launch")]
)
def test_the_sbatch_examples_run_the_verb_on_every_node(sbatch, verb, tmp_path):
    """The examples are valid bash and run one `gpufleet <verb>` per node through srun; the launch one's job
    plans 2 nodes from the variables srun gives node 1 (a dry run: no Slurm, no GPUs here)."""
    from pathlib import Path

    from helpers import run_user

    examples = Path(__file__).resolve().parents[1] / "examples"
    text = (examples / sbatch).read_text()
    assert subprocess.run(["bash", "-n", str(examples / sbatch)]).returncode == 0
    assert "srun --ntasks-per-node=1" in text and f'gpufleet {verb} "$JOB"' in text
    if verb == "launch":
        step = {
            **STEP,
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_NODELIST": "gpu[07-08]",
        }
        job = examples / "launch" / "lerobot-act.yaml"
        p = run_user("launch", str(job), "--gpus", "4x24GB", "--dry-run", cwd=tmp_path, env_extra=step)
        assert p.returncode == 0, p.stdout + p.stderr
        assert (
            "4 processes per node x 2 nodes" in p.stdout and "node 1 of 2; rendezvous gpu07:29634" in p.stdout
        )
        assert "--batch_size=8" in p.stdout  # the single-GPU batch 64 over 8 GPUs
