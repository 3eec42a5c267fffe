"""Episodes played on a dedicated rollout rank (`placement.rollout`): an env job's (`env.name`), and those of
TRL's tools on a data set (rollout.tools without env.name, rl/tooldata.py).

The rollout rank plays whole episodes itself, with the episode code the policy ranks run when they play
their own (rl/episodes.py `play`): it opens its own way to the environments (env/connect.py `open_pool`:
every environment server of its node, gpufleet's or env.address's, or in-process environments with
env.servers 0), resets each episode with the seed of its group and samples each turn with the episode's
own stream, so the episodes are those the policy ranks would have played (the same per-episode seeds);
a crashed server is replayed and a stuck environment stopped by env.reset_timeout / env.step_timeout, as
on a policy rank (env/client.py). Tools on a data set open no environment (`NoEnv`): each group reads its
data row as a policy rank would (the seeded order of rl/data.py, the same on every rank), the tools run
here, in this process, with rollout.tool_timeout, and the row's columns and TRL's message lists travel back
with the episodes for the reward functions. Asked for them (`algorithm.importance_sampling_correction`
where the sampler can differ: rl/sampler.py `differs`), it records the sampling log-prob of every policy
token while decoding; observations, tool results and chat bridges (mask 0) have 0.

A policy rank asks for its rows of generation batch g as (row, group position) pairs with their sampling
seeds (`request`); the rollout rank plays every policy rank's rows at once and answers each with its
rows (`answer`: tokens, masks, the env's rewards, the episode counts and texts, over rl/rolloutwire.py).
The exchange is rl/rollouts.py's `fetch`, so `rollout.async_steps` k plays batch g + k while batch g
trains, and a checkpoint saves the batches in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime
from gpufleet.engine.rollout import Rollout, Sampling
from gpufleet.rl.episodes import Episodes, play
from gpufleet.rl.rolloutwire import Answer, pack_answer
from gpufleet.rl.tooldata import NoEnv, episode_config, tools_on_data


@dataclass(frozen=True)
class _Recording:
    """Sampling settings whose `generate` records the sampling log-probs (or not)."""

    sampling: Sampling
    logprobs: bool

    def generate(self, *args, **kw) -> Rollout:
        return self.sampling.generate(*args, logprobs=self.logprobs, **kw)


@dataclass
class Player:
    """What `episodes.play` needs, on a rollout rank: its model, tokenizer and environments, as one process
    of its own (no policy rank to step with: `rt` is this process alone)."""

    job: Job
    rt: Runtime
    policy: torch.nn.Module
    tokenizer: object
    env: object
    sampling: _Recording | None = None
    chat: object | None = None

    @property
    def train_model(self) -> torch.nn.Module:
        return self.policy

    @property
    def device(self) -> torch.device:
        return self.rt.device


def player(job: Job, rt: Runtime, model: torch.nn.Module) -> Player:
    """The rollout rank's player: the tokenizer, and this node's environments (every server of it); for
    tools on a data set no environment (`NoEnv`): the episodes read their data rows (rl/tooldata.py `rows`,
    the seeded order every rank reads) and call the tools here."""
    from gpufleet.models import load_tokenizer

    alone = Runtime(rt.rank, node_rank=rt.node_rank, policy_ranks=[rt.rank], device=rt.device, clock=rt.clock)
    if tools_on_data(job):
        env = NoEnv()
    else:
        from gpufleet.env.connect import open_pool
        from gpufleet.paths import user_path

        env = open_pool(job, alone, user_path(job.output.dir))  # one policy rank per node: all its servers
    return Player(job, alone, model, load_tokenizer(job.model.path), env)


def answer(pl: Player, asks: list[dict]) -> list:
    """Play every policy rank's rows of one request at once; each rank's rows packed to be sent."""
    first = asks[0]["ask"]
    pl.sampling = _Recording(first["sampling"], bool(first["logprobs"]))
    rows = [row for a in asks for row in a["ask"]["prompt_ids"]]  # (row, group position, batch)
    seeds = [s for a in asks for s in a["ask"]["seeds"]]
    spent = pl.rt.clock.seconds
    before = spent["env"] + spent["tools"]
    ep = play(pl, [r[0] for r in rows], [r[1] for r in rows], seeds, rows[0][2])
    seconds = spent["env"] + spent["tools"] - before
    ep = replace(ep, rollout=ep.rollout.to("cpu"), loss_mask=ep.loss_mask.cpu())  # once, then cut per rank
    out, start = [], 0
    for a in asks:
        stop = start + len(a["ask"]["prompt_ids"])
        answer = _rows(ep, start, stop, a["version"])
        answer.played["seconds"] = seconds
        out.append(pack_answer(answer))
        start = stop
    return out


def _rows(ep: Episodes, start: int, stop: int, version: int) -> Answer:
    """Episodes start..stop-1 (on the CPU) as `play` would have returned them alone (padded only as wide
    as they need)."""
    r = ep.rollout  # as wide as the longest episode (`completion_lengths` counts policy tokens)
    rollout = replace(r, completion_lengths=r.completion_mask.sum(1)).rows(start, stop)
    rollout = replace(rollout, completion_lengths=r.completion_lengths[start:stop])
    T = rollout.completion_ids.shape[1]
    played = {
        "loss_mask": ep.loss_mask[start:stop, :T],
        "env_rewards": ep.env_rewards[start:stop],
        "counts": {k: v[start:stop] for k, v in ep.counts.items()},
        "rest": {f.name: _cut(getattr(ep, f.name), start, stop) for f in fields(ep) if f.name not in TENSORS},
    }
    logprobs = None if ep.logprobs is None else ep.logprobs[start:stop, :T]
    return Answer(rollout, logprobs, version, played)


def episodes(
    p, rows: list[int], row_pos: list[int], seeds: list[int], gen_index: int, layout: Callable
) -> tuple[Episodes, Answer | None]:
    """This policy rank's episodes of generation batch `gen_index`: played here, or by its rollout rank
    (then with the rollout rank's answer, for rl/sampler.py); `layout(p, g)`: (rows, positions, seeds) of
    batch g."""
    from gpufleet.rl import rollouts

    if p.remote is None:
        return play(p, rows, row_pos, seeds, gen_index), None
    got = rollouts.fetch(p.remote, p.policy, gen_index, lambda g: request(p, g, layout))
    p.remote.env_seconds += got.played.get("seconds", 0.0)
    return episodes_of(got, p.device), replace(got, rollout=got.rollout.to(p.device))


def request(p, gen_index: int, layout: Callable) -> dict | None:
    """What the rollout rank needs to play this rank's episodes of batch `gen_index` (None past the run's
    last one)."""
    from gpufleet.rl import sampler
    from gpufleet.rl.batch import reuse_count

    if gen_index * reuse_count(p.job) >= p.job.train.max_steps:
        return None
    rows, row_pos, seeds = layout(p, gen_index)
    return {
        "play": True,
        "prompt_ids": [[j, pos, gen_index] for j, pos in zip(rows, row_pos, strict=True)],
        "seeds": seeds,
        "max_new_tokens": episode_config(p.job).max_action_tokens,
        "sampling": p.sampling,
        "logprobs": p.job.algorithm.importance_sampling_correction and sampler.differs(p.job),
    }


TENSORS = ("rollout", "loss_mask", "env_rewards", "counts", "logprobs")
"""`Episodes` fields that travel as tensors; the others (texts, per-episode lists) travel pickled."""


def _cut(value, start: int, stop: int):
    """Episodes start..stop-1 of a per-episode field: a list, a dict or tuple of lists, or None. TRL's
    `environments` (the instances, rl/trlenv.py) stay in this process (check refuses a reward function
    that takes them with rollout ranks: rules/rollout.py)."""
    if isinstance(value, dict):
        return {k: v[start:stop] for k, v in value.items() if k != "environments"}
    if isinstance(value, tuple):
        return tuple(v[start:stop] for v in value)
    return None if value is None else value[start:stop]


def episodes_of(a: Answer, device: torch.device) -> Episodes:
    """The `Episodes` of a rollout rank's answer, as `play` returns them (tensors on `device`)."""
    d = a.played
    rest = dict(d["rest"])
    rest["segments"] = [[tuple(s) for s in row] for row in rest["segments"]]
    return Episodes(
        rollout=a.rollout.to(device),
        loss_mask=d["loss_mask"].to(device),
        env_rewards=d["env_rewards"],
        counts=dict(d["counts"]),
        logprobs=a.logprobs,
        **rest,
    )


def close(pl: Player | None) -> None:
    """Let the rollout rank's environments go (its servers stay up: the launcher stops them)."""
    if pl is not None and hasattr(pl.env, "shutdown"):
        pl.env.shutdown()
