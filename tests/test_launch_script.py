"""`gpufleet launch`: someone else's script on N processes — the recipe arithmetic, a real DDP script through
the installed command from a user's folder, each failure cause produced for real, Ctrl-C without orphans."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from gpufleet.config.schema import ScriptSection
from gpufleet.errors import UserError
from gpufleet.launch import recipe
from helpers import console_script, run_user
from test_interrupt import gone, processes_of

# --- the arithmetic, against hand-computed values ---------------------------------------------------


def test_keep_effective_batch_splits_with_the_largest_per_device_batch():
    s = ScriptSection(
        per_device_batch=8, gradient_accumulation_steps=2, reference_devices=1, learning_rate=1e-4
    )
    now = recipe.scaled(s, 4)  # effective 16 over 4 devices: 4 per device, no accumulation
    assert (now.per_device_batch, now.grad_accum, now.effective_batch) == (4, 1, 16)
    assert now.learning_rate == 1e-4
    s = ScriptSection(per_device_batch=2, gradient_accumulation_steps=4)
    assert recipe.split_batch(8, 2, 2) == (2, 2)
    assert recipe.scaled(s, 2).grad_accum == 2  # capped at the reference's per-device batch


def test_keep_per_device_batch_scales_lr_and_steps():
    s = ScriptSection(
        per_device_batch=8,
        learning_rate=1e-4,
        max_steps=1000,
        batch_rule="keep_per_device_batch",
        lr_rule="sqrt",
    )
    now = recipe.scaled(s, 4)  # effective 8 -> 32, ratio 4: lr x 2, steps / 4
    assert now.effective_batch == 32 and math.isclose(now.learning_rate, 2e-4) and now.max_steps == 250
    s.lr_rule = "linear"
    assert math.isclose(recipe.scaled(s, 4).learning_rate, 4e-4)


def test_indivisible_effective_batch_names_the_nearest_values():
    with pytest.raises(UserError) as e:
        recipe.scaled(ScriptSection(per_device_batch=8), 3)
    text = str(e.value)
    assert (
        "script.per_device_batch" in text and "6 or an effective batch of 9" in text and "1, 2, 4, 8" in text
    )


def test_placeholders_filled_and_unknown_ones_refused():
    known = recipe.values(recipe.scaled(ScriptSection(per_device_batch=4, learning_rate=0.001), 2), 2, "out")
    assert recipe.fill(["--bs", "{per_device_batch}", "--lr={learning_rate}"], known) == [
        "--bs",
        "2",
        "--lr=0.001",
    ]
    with pytest.raises(UserError, match=r"\{batch\}.*not a placeholder"):
        recipe.fill(["{batch}"], known)
    with pytest.raises(UserError, match="not set in this job"):
        recipe.fill(["{max_steps}"], known)


# --- real processes ---------------------------------------------------------------------------------

DDP = """
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
bs, lr = int(sys.argv[sys.argv.index("--bs") + 1]), float(sys.argv[sys.argv.index("--lr") + 1])
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=lr)
for step in range(3):
    x = torch.randn(bs, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"step {step} loss {loss.item():.4f} rank {rank} bs {bs} env {os.environ['GPUFLEET_PER_DEVICE_BATCH']}")
w = model.module.weight.detach().clone(); others = [torch.zeros_like(w) for _ in range(2)]
dist.all_gather(others, w)
assert torch.equal(others[0], others[1]), "replicas diverged"
print("replicas equal", flush=True)
# Tear down in order, after both ranks are done. Even so, torch 2.13's gloo threads abort interpreter
# finalisation now and then ("terminate called without an active exception", SIGABRT; 1 in 25 runs of
# this script under plain torchrun, no gpufleet involved; pytorch/pytorch#190489): skip finalisation,
# as this test is about the launcher, not about torch's teardown.
del model, opt
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""

JOB = """
script:
  command: python train.py --bs {per_device_batch} --lr {learning_rate}
  per_device_batch: 8
  learning_rate: 0.01
output:
  dir: run
"""


def folder(tmp_path: Path, **scripts: str) -> Path:
    home = tmp_path / "me"
    home.mkdir()
    (home / "job.yaml").write_text(JOB)
    (home / "train.py").write_text(DDP)
    for name, body in scripts.items():
        (home / f"{name}.py").write_text(textwrap.dedent(body))
    return home


@pytest.mark.slow
def test_a_real_ddp_script_on_two_processes(tmp_path):
    home = folder(tmp_path)
    p = run_user("launch", "job.yaml", "--gpus", "cpu", "--nproc", "2", cwd=home, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "python train.py --bs 4 --lr 0.01" in p.stdout  # effective batch 8 kept over 2 ranks
    assert "step 2 loss" in p.stdout and "rank 0 bs 4 env 4" in p.stdout and "rank 1" not in p.stdout
    assert "replicas equal" in (home / "run" / "logs" / "rank1.log").read_text()
    assert "done: 2 ranks finished" in p.stdout


CAUSES = {
    "oom": (
        'import torch, torch.distributed as dist\ndist.init_process_group("gloo")\nif dist.get_rank() == 1:\n'
        '    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")\ndist.barrier()\n',
        "rank 1 failed first: out of GPU memory at per-device batch 4. Fix: --set script.per_device_batch=2 "
        "--set script.gradient_accumulation_steps=4",
    ),
    "missing": ("import not_installed_pkg_xyz\n", "pip install not_installed_pkg_xyz"),
    "early": (  # rank 1 returns cleanly while rank 0 waits for it in a collective
        'import time, torch.distributed as dist\ndist.init_process_group("gloo")\nif dist.get_rank() == 1:\n'
        "    raise SystemExit(0)\ntime.sleep(1)\ndist.barrier()\n",
        "failed first: rank 1 ended (exit code 0)",
    ),
    "killed": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed by SIGKILL"),
    "abort": ("import os\nos.abort()\n", "the command was killed by SIGABRT (signal 6)"),
    "loader": (
        "import os, signal, torch\nfrom torch.utils.data import DataLoader, Dataset\n"
        "class D(Dataset):\n    def __len__(self): return 8\n"
        "    def __getitem__(self, i): os.kill(os.getpid(), signal.SIGKILL)\n"
        "for _ in DataLoader(D(), num_workers=1): pass\n",
        "DataLoader num_workers",
    ),
    "port": (
        "import os, socket\ns = socket.socket()\ns.bind(('127.0.0.1', int(os.environ['HELD_PORT'])))\n",
        "already in use",
    ),
}


def launch_broken(home: Path, env: dict[str, str] | None = None):
    """`gpufleet launch job.yaml --gpus cpu --nproc 2 -- python broken.py` from the user's folder."""
    argv = ["launch", "job.yaml", "--gpus", "cpu", "--nproc", "2", "--", "python", "broken.py"]
    return run_user(*argv, cwd=home, env_extra=env, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_each_failure_is_named_with_its_fix(tmp_path, cause):
    import socket

    body, expected = CAUSES[cause]
    home = folder(tmp_path, broken=body)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        p = launch_broken(home, {"HELD_PORT": str(held.getsockname()[1])})
    assert p.returncode == 1, p.stdout + p.stderr
    assert expected in p.stderr, p.stderr
    summary = p.stderr[p.stderr.index("gpufleet: rank") :]  # the ranks' own stderr comes before it
    assert 'Traceback (most recent call last):\n  File "/' not in summary.split("last lines")[0]


def test_missing_script_and_what_if_hardware(tmp_path):
    home = folder(tmp_path)
    p = run_user("launch", "job.yaml", "--gpus", "cpu", "--", "python", "nope.py", cwd=home)
    assert p.returncode == 2 and "nope.py does not exist" in p.stderr and "Nothing was started" in p.stderr
    p = run_user("launch", "job.yaml", "--gpus", "4x24GB", cwd=home)
    assert p.returncode == 2 and "--dry-run" not in p.stderr or "what-if" in p.stderr, p.stderr
    p = run_user("launch", "job.yaml", "--gpus", "4x24GB", "--dry-run", cwd=home)
    assert p.returncode == 0 and "python train.py --bs 2 --lr 0.01" in p.stdout, p.stdout + p.stderr
    assert not (home / "run").exists()


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    sleepy = "import os, time\nopen(f\"pid{os.environ['RANK']}\", 'w').write(str(os.getpid()))\nprint('up', flush=True)\nwhile True: time.sleep(0.1)\n"
    home = folder(tmp_path, sleepy=sleepy)
    run = home / "run"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [
        console_script(),
        "launch",
        "job.yaml",
        "--gpus",
        "cpu",
        "--nproc",
        "2",
        "--set",
        f"output.dir={run}",
        "--",
        "python",
        "sleepy.py",
    ]
    p = subprocess.Popen(
        argv,
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not all((home / f"pid{r}").exists() for r in (0, 1)):  # both ranks' scripts are running
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, out + err
    assert "every rank was stopped" in err and "Traceback" not in err
    assert gone(run), processes_of(run)
    scripts = [int((home / f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in scripts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in scripts), "the user's script outlived the launch"


@pytest.mark.slow
def test_a_script_shipped_in_accelerate_runs_on_two_processes(tmp_path):
    """Issue 10 item 5: a real training script nobody here wrote (accelerate's gradient-sync test: DDP,
    gradient accumulation, no_sync), launched as a user would."""
    p = run_user(
        "launch",
        "--gpus",
        "cpu",
        "--nproc",
        "2",
        "--set",
        "output.dir=run",
        "--",
        "python",
        "-m",
        "accelerate.test_utils.scripts.test_sync",
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gradient accumulation" in p.stdout and "done: 2 ranks finished" in p.stdout
    assert (tmp_path / "run" / "logs" / "rank1.log").read_text().count("Test") >= 3


@pytest.mark.parametrize(
    "example, gpus, expected",
    [
        ("lerobot-act.yaml", "4x24GB", "--batch_size=16 --steps=100000 --optimizer.lr=0.0001"),
        ("rdt-libero.yaml", "2x24GB", "--train_batch_size=8 --gradient_accumulation_steps=1"),
        ("ms-swift-grpo.yaml", "4x24GB", "--per_device_train_batch_size 4 --gradient_accumulation_steps 1"),
    ],
)
def test_examples_for_the_user_notes_scale_with_dry_run(tmp_path, example, gpus, expected):
    """Issue 10 item 5: LeRobot / RDT / ms-swift command lines, their placeholders filled for N GPUs (the
    packages are not installed here: a missing command is a warning for --dry-run, which runs nothing)."""
    job = Path(__file__).resolve().parents[1] / "examples" / "launch" / example
    p = run_user("launch", str(job), "--gpus", gpus, "--dry-run", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert expected in p.stdout and "{" not in p.stdout.splitlines()[0], p.stdout
    assert not (tmp_path / "runs").exists()


def test_scaling_arithmetic_by_hand():
    from gpufleet.launch.scaling import Point, table, throughput

    assert throughput([Point(10.0, 100), Point(12.0, 300), Point(14.0, 500)]) == 100.0
    assert throughput([Point(1.0, 5)]) is None
    text = table([(1, 100.0), (2, 150.0), (4, None)])
    assert "1.50x" in text and "75%" in text and "fewer than 2 progress lines" in text


SCALING_DDP = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from gpufleet.progress import report
dist.init_process_group("gloo")
rank, world, bs = dist.get_rank(), dist.get_world_size(), int(sys.argv[1])
model = DDP(torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    loss = model(torch.randn(bs, 64)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); step += 1
    if rank == 0 and step % 5 == 0:
        report(step * bs * world)
"""


@pytest.mark.slow
def test_scaling_measures_each_process_count(tmp_path):
    """Issue 10 item 4: --scaling runs a real DDP script at 1 and 2 processes and reports samples/s."""
    home = folder(tmp_path, ddp=SCALING_DDP)
    p = run_user(
        "launch", "job.yaml", "--gpus", "cpu", "--scaling", "1,2", "--scaling-seconds", "3",
        "--", "python", "ddp.py", "{per_device_batch}", cwd=home, timeout=180,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if re.match(r"\s+[12]\s+\d+\.\d", line)]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[1]) > 0 for r in rows), p.stdout
    assert "python ddp.py 4" in p.stdout  # effective batch 8 kept: 4 per process on 2
    assert "share the same cores" in p.stdout
    assert (home / "run" / "scaling-2" / "logs" / "progress.jsonl").is_file()
