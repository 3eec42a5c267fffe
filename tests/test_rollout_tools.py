"""Tools on a data set (TRL's `tools=` without an environment: rollout.tools, no env.name) on a dedicated
rollout rank (`placement.rollout`, rl/rolloutplay.py): the rollout rank reads each group's data row in the
seeded order a policy rank reads, plays TRL's tool loop (the tools called in its process) and sends the
finished episodes back with the rows' columns and TRL's message lists, so the reward functions get what
they get colocated and lock-step training equals the colocated run (1 or 2 policy ranks); with
`rollout.async_steps: 1` the next batch is played while this one trains (one step stale, the sampling
log-probs of every policy token in the importance-sampling correction, 0 on tool results and bridges),
deterministic and resumed exactly after kill -9. check accepts the layout and plan proposes it. Real
torchrun processes (gloo) and the installed command from a user's folder."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import console_script, kill9_after_steps, run_user, sets
from test_rollout_ranks import _metrics, _weights, assert_same_run
from test_tools_dataset import _files, _job

# A TRL-style reward function that scores the tool calls and the answer (so groups' rewards differ and the
# weights move) and writes down every argument it got.
REWARDS = """
import json


def shaped(prompts, completions, ground_truth, level, completion_ids, trainer_state, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step, "prompts": prompts, "completions": completions,
                            "ground_truth": list(ground_truth), "level": list(level), "ids": completion_ids,
                            "keys": sorted(kwargs)}) + "\\n")
    out = []
    for c, gt in zip(completions, ground_truth):
        calls = sum(len(m.get("tool_calls") or []) for m in c)
        last = str(c[-1].get("content") or "")
        out.append(calls + float(last == gt) + 0.02 * len(last))
    return out
"""

JOB = """
model: {path: builtin:tiny-qwen2}
data: {path: tasks.jsonl}
rollout:
  tools: [my_tools.py:multiply, my_tools.py:add]
  max_tool_calling_iterations: 2
  max_prompt_length: 48
  max_completion_length: 32
reward: {functions: [shaped.py:shaped]}
algorithm: {num_generations: 4}
train: {per_device_batch: 16, max_steps: 4, log_every: 1, learning_rate: 0.003}
output: {dir: run, save_every: 0}
"""
ASYNC = ("placement.rollout=1", "rollout.async_steps=1")


def _user(tmp_path: Path) -> Path:
    _files(tmp_path)
    (tmp_path / "shaped.py").write_text(REWARDS)
    (tmp_path / "job.yaml").write_text(textwrap.dedent(JOB))
    return tmp_path


def _train(user: Path, run: str, *values: str) -> Path:
    """Train job.yaml into `run`; the reward function's record of its arguments kept as run/seen.jsonl."""
    p = run_user("train", "job.yaml", *sets(f"output.dir={run}", *values), cwd=user, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    (user / "seen.jsonl").rename(user / run / "seen.jsonl")
    return user / run


def _seen(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "seen.jsonl").read_text().splitlines()]


def test_the_rollout_rank_plays_the_data_rows_as_a_policy_rank_does(tmp_path):
    """The rollout rank's player (no environment, the data rows read there) plays a batch's episodes as the
    policy rank plays them: the same prompts, tokens, masks, tool messages and data columns; each policy
    rank's rows cut out as it would have played them alone; the sampling log-prob of every policy token
    recorded (the trainer's, in fp32), 0 on the tool results and bridges."""
    from gpufleet.rl import rolloutplay
    from gpufleet.rl.batch import GenerationBatch, logprobs_of
    from gpufleet.rl.episodes import play
    from gpufleet.rl.parts import build

    _files(tmp_path)
    p = build(_job(tmp_path, max_tool_calling_iterations=2, temperature=1.5, max_completion_length=96))
    pl = rolloutplay.player(p.job, p.rt, p.policy)
    assert pl.env.__class__.__name__ == "NoEnv"
    rows, pos, seeds = list(range(16)), [9 + j // 4 for j in range(16)], [101 + j for j in range(16)]
    here = play(p, rows, pos, seeds, gen_index=2)
    pl.sampling = rolloutplay._Recording(p.sampling, True)  # as `answer` sets it when asked for them
    there = play(pl, rows, pos, seeds, gen_index=2)
    assert here.counts["tool_calls"].sum() > 0  # the episodes did call the tools (on the rollout rank there)
    for name in ("prompt_ids", "completion_ids", "completion_mask", "completion_lengths", "is_truncated"):
        assert torch.equal(getattr(here.rollout, name), getattr(there.rollout, name)), name
    assert torch.equal(here.loss_mask, there.loss_mask)
    assert (here.prompts, here.transcripts, here.columns) == (there.prompts, there.transcripts, there.columns)
    assert here.conversation == there.conversation and here.columns["ground_truth"][0] is not None
    assert all(torch.equal(here.counts[k], there.counts[k]) for k in here.counts)
    lp, mask = there.logprobs, there.loss_mask
    assert here.logprobs is None and lp is not None
    assert torch.all(lp[mask == 0] == 0) and torch.all(lp[mask == 1] < 0)
    assert (mask[there.rollout.completion_mask.bool()] == 0).any()  # tool results were spliced in
    r = there.rollout
    batch = GenerationBatch(r.input_ids, r.attention_mask, mask, mask[:, 0], None, None, r.completion_start)
    trainer = logprobs_of(p.policy, batch, 1.5, 16, torch.no_grad, p.suppress_tokens, p.early)
    assert torch.allclose(lp * mask, trainer * mask, atol=1e-4)
    second = rolloutplay.episodes_of(rolloutplay._rows(there, 8, 16, 0), p.device)  # policy rank 1's rows
    alone = play(p, rows[8:], pos[8:], seeds[8:], gen_index=2)
    assert torch.equal(second.rollout.completion_ids, alone.rollout.completion_ids)
    assert torch.equal(second.loss_mask, alone.loss_mask)
    assert (second.columns, second.conversation) == (alone.columns, alone.conversation)


def test_check_accepts_tools_on_data_with_rollout_ranks_ahead(tmp_path):
    """The layout check refused before: 1 policy rank + 1 rollout rank, one step ahead; what stays untrue is
    still refused (min_completion_length in tool episodes). A GPU layout: tests/test_plan_rollout_split.py."""
    user = _user(tmp_path)
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(*ASYNC), cwd=user)
    assert p.returncode == 0 and "rollout on cpu process 1" in p.stdout, p.stdout + p.stderr
    p = run_user(
        "check", "job.yaml", "--gpus", "cpu", *sets(*ASYNC, "rollout.min_completion_length=2"), cwd=user
    )
    assert p.returncode == 2 and "min_completion_length is not implemented" in p.stdout, p.stdout
    assert "rollout ranks do not play them" not in p.stdout


@pytest.mark.slow
def test_tools_on_data_on_rollout_ranks_train_to_the_colocated_weights(tmp_path):
    """Lock-step, 4 steps: 1 policy rank + 1 rollout rank equals the colocated run (weights within 1e-5;
    the reward function called with the same arguments -- message lists, the rows' columns, completion ids,
    trainer_state --; the same samples; the tools called on the rollout rank, not here), and so do 2 policy
    ranks + 1 rollout rank with the same global batch."""
    user = _user(tmp_path)
    colocated = _train(user, "colocated")
    remote = _train(user, "remote", "placement.rollout=1")
    two = _train(user, "two", "placement.policy=0,1", "placement.rollout=2", "train.per_device_batch=8")
    rows = _metrics(colocated)
    assert max(m["grad_norm"] for m in rows) > 0 and sum(m["tools/call_frequency"] for m in rows) > 0
    assert_same_run(colocated, remote)
    assert_same_run(colocated, two)
    assert _seen(colocated) == _seen(remote)
    assert (colocated / "samples.jsonl").read_text() == (remote / "samples.jsonl").read_text()
    for m, n in zip(rows, _metrics(remote), strict=True):
        assert m["tools/call_frequency"] == n["tools/call_frequency"]
        assert m["timing/tools"] > 0 and n["timing/tools"] == 0 and n["timing/rollout_env"] > 0
    assert [_scored(s for s in _seen(two) if s["step"] == k) for k in range(4)] == [
        _scored([s]) for s in _seen(colocated)
    ]


def _scored(calls) -> list[str]:
    """What the reward function saw per completion in a step (each policy rank scores its own rows), as
    sorted JSON: prompt, completion messages, the row's columns."""
    keys = ("prompts", "completions", "ground_truth", "level")
    return sorted(json.dumps([s[k][i] for k in keys]) for s in calls for i in range(len(s["prompts"])))


@pytest.mark.slow
def test_async_tools_on_data_is_one_step_stale_corrected_and_resumes_exactly_after_kill_9(tmp_path):
    """async_steps 1: batch g is played while g - 1 trains (staleness 1 from the second step), the policy
    tokens' sampling log-probs meet the trainer's in the IS ratio; the whole run killed with SIGKILL after
    5 steps resumes from the step-3 checkpoint (the episodes in flight saved with it, their data columns and
    message lists too) to the weights, rewards and metrics of an undisturbed run, bit for bit, its reward
    function called with the same arguments from there on. (A kill that lands after the step-6 checkpoint
    was written resumes from that one: CI saw it once.)"""
    user = _user(tmp_path)
    values = (*ASYNC, "train.max_steps=8", "output.save_every=3")
    one = _train(user, "one", *values)
    rows = _metrics(one)
    assert [m["rollout/staleness"] for m in rows] == [0.0] + [1.0] * 7
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-5  # the same weights: ratio 1
    assert all(m["sampling/sampling_logp_difference/mean"] > 0 for m in rows[1:])
    assert all(0 < m["sampling/importance_sampling_ratio/max"] <= 3.0 for m in rows)
    argv = [console_script(), "train", "job.yaml", *sets("output.dir=two", *values)]
    kill9_after_steps(argv, user / "two", 5, cwd=user, log=user / "killed.log")
    # the checkpoint it resumes from: step-3, or step-6 when the kill landed after that one was written
    start = int((user / "two" / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    assert start in (3, 6)
    saved = torch.load(user / "two" / "checkpoints" / f"step-{start}" / "batch-rank0.pt", weights_only=True)
    (flight,) = saved["in_flight"].values()
    rest = flight["played"]["rest"]
    assert len(rest["columns"]["ground_truth"]) == 16 and rest["conversation"]["completions"]
    assert flight["logprobs"] is not None
    (user / "seen.jsonl").unlink()
    two = _train(user, "two", *values)
    wa, wb = _weights(one), _weights(two)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    keys = [k for k in rows[0] if k.startswith(("reward", "sampling/", "rollout/staleness", "tools/"))]
    assert [[m[k] for k in keys] for m in _metrics(two)] == [[m[k] for k in keys] for m in rows]
    assert _seen(two) == [s for s in _seen(one) if s["step"] >= start]


@pytest.mark.slow
def test_async_tools_on_data_does_not_depend_on_the_policy_rank_count(tmp_path):
    """One step ahead, 2 policy ranks whose episodes one rollout rank plays train as 1 policy rank with the
    same global batch: weights within 1e-5, rewards, tool metrics and TRL's sampling metrics."""
    user = _user(tmp_path)
    values = ("train.max_steps=5", "rollout.async_steps=1")
    one = _train(user, "one", *values, "placement.rollout=1")
    two = _train(
        user, "two", *values, "placement.policy=0,1", "placement.rollout=2", "train.per_device_batch=8"
    )
    assert_same_run(one, two)
    keys = [k for k in _metrics(one)[0] if k.startswith(("sampling/", "rollout/staleness", "tools/"))]
    assert len([k for k in keys if k.startswith("sampling/")]) == 5
    for a, b in zip(_metrics(one), _metrics(two), strict=True):
        assert [b[k] for k in keys] == pytest.approx([a[k] for k in keys], rel=1e-4, abs=1e-6, nan_ok=True)
