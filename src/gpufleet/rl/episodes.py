"""The multi-turn rollout: the policy acts, the environments answer, and only the policy's tokens train.

One episode, as the policy sees it and as it is trained:

    [instructions + first observation]  [action 1][observation 1][action 2][observation 2] ... [action n]
     prompt (left-padded, not trained)   policy    environment    policy    environment        policy
                                         mask 1    mask 0         mask 1    mask 0             mask 1

Per turn, every live episode of this rank samples its action together (one batched `generate` over the
whole transcript so far, KV cache within the turn): up to `env.max_action_tokens` tokens, ending early at
EOS (kept, trained: it is how the policy ends its turn). The environments step in one batch per server;
an observation is tokenised (its first `env.max_observation_tokens` tokens) and appended with loss mask 0.
An episode ends when the environment says terminated or truncated, at `env.max_turns`, or when the next
turn would pass `env.max_episode_tokens` (truncated).

With env.format chat (rl/chat.py, rl/chatturns.py) the same episode is laid out by the model's chat
template: the prompt is [user(first observation)] rendered once with rollout.tools and the generation
prompt; after each action come the template's bridge tokens (end of turn, the observation as a user
message or a tool call's results as tool messages, the next generation prompt; mask 0), computed as
TRL's `_get_tool_suffix_ids` does; a turn with tool calls is answered by its tools (up to
rollout.max_tool_calling_iterations such turns), any other goes to the environment as its content.
Every policy turn counts against env.max_turns; bridges count against the episode budget.

The result is an ordinary generation batch: `completion_start` is the first prompt's padded length,
`attention_mask` covers actions and observations, `completion_mask` (the loss mask) the actions only, so
losses, normalisers (dapo / bnpo count policy tokens), log-probs and the KL see the policy's tokens only.
The tokens trained are the tokens sampled (never re-tokenised text), at the same positions.

Determinism (rank invariance, exact resume): episode j of the generation batch resets with the seed of
its group (train.seed and the group's position; the G episodes of a group share it) and samples turn t
with its own random stream (`turn_seed`), so nothing depends on which rank or server runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpufleet.engine.rollout import Rollout, left_pad
from gpufleet.env.connect import env_errors
from gpufleet.rl import chatturns, tooldata, trlenv
from gpufleet.rl.batch import encode_prompt, keep_last
from gpufleet.rl.parts import sample

SEED_SPACE = 2**31
"""Environment seeds stay below this (what numpy's and Gymnasium's seeding take everywhere)."""


def episode_seed(seed: int, position: int) -> int:
    """The reset seed of the group at `position` of the prompt stream (shared by its G episodes)."""
    return (seed * 1_000_003 + position * 7_919 + 17) % SEED_SPACE


def turn_seed(sample_seed: int, turn: int) -> int:
    """Sampling seed of turn `turn` of an episode whose first turn would use `sample_seed`, folded into
    [0, 2**64) (the seeds torch.Generator takes: a large train.seed made it overflow)."""
    return (sample_seed * 1_009 + turn) % 2**64


@dataclass
class _Episode:
    id: str
    seed: int
    sample_seed: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    segments: list[tuple[str, bool]] = field(default_factory=list)  # (text, is policy's)
    reward: float = 0.0
    turns: int = 0
    invalid: int = 0
    observed: int = 0
    cut: int = 0
    success: float = 0.0  # what info["success"] said last; an episode that never says is no success
    done: bool = False
    truncated: bool = False
    tool_rounds: int = 0  # chat: turns answered by tools
    tool_calls: int = 0
    tool_failures: int = 0
    logprobs: list[float] = field(default_factory=list)  # per token: the sampling log-prob (0 off-policy)
    sampled: list[float] = field(default_factory=list)  # this turn's action's, until `_action` keeps them
    said: list[dict] = field(default_factory=list)  # chat: the first prompt's messages (TRL's `prompts`)
    messages: list[dict] = field(default_factory=list)  # chat: the completion's messages (TRL's form)


@dataclass
class Episodes:
    """What `play` returns for this rank's rows, in row order."""

    rollout: Rollout
    """prompt_ids/prompt_mask: the first prompt, left-padded; completion_ids: everything after it, right-
    padded; completion_mask: its attention (actions and observations); completion_lengths: policy tokens;
    is_truncated: the episode was cut (turns, tokens, or the environment's own time limit)."""
    loss_mask: torch.Tensor  # (B, T) float: 1 on policy tokens only
    prompts: list[str]
    transcripts: list[str]  # the text after the prompt (actions and observations), for reward functions
    segments: list[list[tuple[str, bool]]]
    env_rewards: torch.Tensor  # (B,) sum of the environment's rewards
    counts: dict[str, torch.Tensor] = field(default_factory=dict)  # (B,) per-episode counts for metrics
    logprobs: torch.Tensor | None = None
    """(B, T) the sampling log-prob of each policy token (0 elsewhere), where `generate` recorded them (a
    dedicated rollout rank: rl/rolloutplay.py); None otherwise."""
    columns: dict[str, list] = field(default_factory=dict)  # tools on a data set: the rows' other columns
    conversation: dict[str, list] | None = None  # chat: TRL's reward arguments (rl/rewards.py)


def play(p, rows: list[int], row_pos: list[int], sample_seeds: list[int], gen_index: int) -> Episodes:
    """Run this rank's episodes of generation batch `gen_index` (row j: group position row_pos, sampling
    seed sample_seeds) to the end; see the module docstring. Environment failures are UserErrors."""
    with env_errors(p.job):
        return _play(p, rows, row_pos, sample_seeds, gen_index)


def _play(p, rows: list[int], row_pos: list[int], sample_seeds: list[int], gen_index: int) -> Episodes:
    cfg, tok = tooldata.episode_config(p.job), p.tokenizer
    chat = _chat(p)
    eps = [
        _Episode(f"g{gen_index}r{j}", episode_seed(p.job.train.seed, pos), s, [])
        for j, pos, s in zip(rows, row_pos, sample_seeds, strict=True)
    ]
    trl = chat.rows if chat is not None else None  # data rows (a TRL environment's, or tools on data)
    with p.rt.clock.phase("env"):
        first = p.env.reset(
            [(e.id, e.seed, *(trl.options(pos) if trl else ())) for e, pos in zip(eps, row_pos, strict=True)]
        )
    prompts = []
    for e, pos, (obs, info) in zip(eps, row_pos, first, strict=True):
        text = (cfg.instructions if cfg.instructions is not None else info.get("instructions", "")) + obs
        if chat is not None:  # rendered once; like any prompt, its last max_prompt_length tokens
            said, text = trl.first(pos, text) if trl else (text, text)
            e.said = [{"role": "user", "content": said}] if isinstance(said, str) else said
            e.prompt = chat.fmt.first_prompt(said, trl.tools(pos) if trl else None)
            whole = f"the first prompt of episode {e.id} (the template's frame, tools and first observation)"
            e.prompt = keep_last(e.prompt, p.job.rollout.max_prompt_length, whole)
        else:
            name = f"the first observation of episode {e.id}"
            e.prompt = encode_prompt(tok, text, p.job.rollout.max_prompt_length, name) or [tok.eos_token_id]
        prompts.append(text)
    budget = cfg.episode_tokens()
    for turn in range(cfg.max_turns):
        live = [e for e in eps if not e.done]
        if not _anyone(p, bool(live)):
            break
        actions, last = _act(p, live, turn, budget), turn == cfg.max_turns - 1
        if chat is None:
            calls, steps = [], [(e, ids, text, text) for e, (ids, text) in zip(live, actions, strict=True)]
        else:
            calls, steps = chatturns.split_turn(chat, live, actions)
            for (e, ids, text, _), results in zip(
                calls, chatturns.run_tools(chat, p.rt.clock, calls), strict=True
            ):
                _record_tools(e, ids, text, results, chat, tok, last_turn=last, budget=budget)
        with p.rt.clock.phase("env"):
            results = p.env.step([(e.id, said) for e, _, _, said in steps]) if steps else []
        for (e, ids, text, _), result in zip(steps, results, strict=True):
            _record(e, ids, text, result, tok, cfg, chat, last_turn=last, budget=budget)
    for e in eps:  # still running after max_turns (only when every rank stopped early: never here)
        if not e.done:
            e.done = e.truncated = True
    environments = trlenv.instances(p.env, [e.id for e in eps]) if chat and chat.trl else None
    with p.rt.clock.phase("env"):
        p.env.close([e.id for e in eps])
    out = _assemble(p, eps, prompts, chatturns.columns(chat, row_pos))
    if environments is not None:  # TRL's `environments` (in this process only)
        out.conversation["environments"] = environments
    return out


def _chat(p) -> chatturns.ChatRun | None:
    """The run's chat layout and tools (env.format: chat), built on first use; None: text episodes."""
    if p.job.env.format != "chat" and not tooldata.tools_on_data(p.job):
        return None
    if p.chat is None:
        p.chat = chatturns.chat_run(p.job, p.tokenizer)
    return p.chat


def _anyone(p, mine: bool) -> bool:
    """Whether any rank still has a live episode (under FSDP every rank must generate in step; with rollout
    ranks the episodes are played there: rl/rolloutplay.py)."""
    rt = p.rt
    if rt.distributed and rt.policy_size > 1 and p.job.placement.strategy == "fsdp":
        from gpufleet.dist import all_true

        return not all_true(rt, not mine)
    return mine


def _act(p, live: list[_Episode], turn: int, budget: int) -> list[tuple[list[int], str]]:
    """Each live episode's action this turn: its tokens (EOS kept, cut to the budget) and its text."""
    cfg, tok = tooldata.episode_config(p.job), p.tokenizer
    contexts = [e.prompt + e.tokens for e in live] or [[tok.eos_token_id]]  # FSDP: a rank with none
    seeds = [turn_seed(e.sample_seed, turn) for e in live] or [0]
    out = sample(p, contexts, seeds, cfg.max_action_tokens)
    actions = []
    for i, (e, ids) in enumerate(zip(live, out.completions(), strict=False)):
        ids = ids[: max(budget - len(e.tokens), 0)]
        e.sampled = [] if out.logprobs is None else out.logprobs[i, : len(ids)].tolist()
        text = tok.decode([i for i in ids if i != tok.eos_token_id], skip_special_tokens=True)
        actions.append((ids, text))
    return actions


def _record(e: _Episode, ids, text, result, tok, cfg, chat, *, last_turn: bool, budget: int) -> None:
    """Append one turn to episode `e`: the action (mask 1), then the observation (mask 0) if it goes on:
    its tokens (text), or the template's user message around it and the next generation prompt (chat)."""
    obs, reward, terminated, truncated, info = result
    _action(e, ids, text)
    e.reward += reward
    e.invalid += bool(info.get("invalid_action", False))
    if "success" in info:
        e.success = float(bool(info["success"]))
    if terminated or truncated:
        e.done, e.truncated = True, bool(truncated)
        return
    if chat is not None and chat.trl is not None:  # a TRL environment answered the turn's tool calls
        answer = trlenv.tool_messages(obs)
        _tools_answered(e, answer, int(info.get("tool_failures", 0)), chat, tok, last_turn, budget)
        return
    obs_ids = tok.encode(obs, add_special_tokens=False)
    e.observed += 1
    if len(obs_ids) > cfg.max_observation_tokens:
        obs_ids, e.cut = obs_ids[: cfg.max_observation_tokens], e.cut + 1
        obs = tok.decode(obs_ids, skip_special_tokens=True)
    if chat is None:
        _splice(e, obs_ids, tok, last_turn, budget)
    else:
        said = [{"role": "user", "content": obs}]
        _splice(e, chatturns.observation_bridge(chat, obs), tok, last_turn, budget, said)


def _record_tools(e: _Episode, ids, text, results, chat, tok, *, last_turn: bool, budget: int) -> None:
    """Append a turn whose tool calls ran: the action (mask 1), then the tool messages and the next
    generation prompt (mask 0) if it goes on."""
    _action(e, ids, text)
    messages = [r.message for r in results]
    _tools_answered(e, messages, sum(r.failed for r in results), chat, tok, last_turn, budget)


def _tools_answered(e: _Episode, messages, failures: int, chat, tok, last_turn: bool, budget: int) -> None:
    """Count a turn's tool calls and splice their `tool` messages and the next generation prompt."""
    e.tool_rounds += 1
    e.tool_calls += len(messages)
    e.tool_failures += failures
    _splice(e, chatturns.tool_bridge(chat, messages), tok, last_turn, budget, messages, fills=True)


def _action(e: _Episode, ids, text) -> None:
    e.logprobs += (e.sampled + [0.0] * len(ids))[: len(ids)]
    e.tokens += ids
    e.mask += [1] * len(ids)
    e.segments.append((text, True))
    e.turns += 1


def _splice(
    e: _Episode, bridge: list[int], tok, last_turn: bool, budget: int, messages=(), fills: bool = False
) -> None:
    """Append the tokens between two actions (mask 0) and, chat, their `messages`; or end the episode
    when no action would fit (the messages dropped, as TRL drops an overlong tool result). `fills`: tool
    results, TRL 1.16's rule (`_tool_call_loop`): dropped only past the budget; results that exactly fill
    it are kept (tokens, mask 0, and messages) and end the episode (TRL samples again and keeps nothing)."""
    room = budget - len(e.tokens) - len(bridge)
    if last_turn or room < (0 if fills else 1):  # no room for another action (or, tools, for them)
        e.done = e.truncated = True
        return
    e.messages += messages
    e.tokens += bridge
    e.mask += [0] * len(bridge)
    e.logprobs += [0.0] * len(bridge)
    e.segments.append((tok.decode(bridge, skip_special_tokens=True), False))
    if room == 0:
        e.done = e.truncated = True


def _assemble(p, eps: list[_Episode], prompts: list[str], columns: dict[str, list]) -> Episodes:
    """Tensors of the episodes: the generation batch's layout (see the module docstring)."""
    tok, device = p.tokenizer, p.device
    prompt_ids, prompt_mask = left_pad([e.prompt for e in eps], tok.pad_token_id, device)
    width = max(1, max(len(e.tokens) for e in eps))
    ids = torch.full((len(eps), width), tok.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(eps), width), dtype=torch.long)
    loss = torch.zeros((len(eps), width), dtype=torch.float32)
    for i, e in enumerate(eps):
        n = len(e.tokens)
        ids[i, :n] = torch.tensor(e.tokens, dtype=torch.long)
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(e.mask, dtype=torch.float32)
    logprobs = None
    if any(e.sampled for e in eps):  # recorded while decoding (a rollout rank's turns)
        logprobs = torch.zeros((len(eps), width), dtype=torch.float32)
        for i, e in enumerate(eps):
            logprobs[i, : len(e.logprobs)] = torch.tensor(e.logprobs, dtype=torch.float32)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids.to(device),
        completion_mask=attention.to(device),
        completion_lengths=torch.tensor([sum(e.mask) for e in eps], device=device),
        is_truncated=torch.tensor([_truncated(p, e) for e in eps], device=device),
    )
    counts = {
        "turns": torch.tensor([float(e.turns) for e in eps]),
        "invalid": torch.tensor([float(e.invalid) for e in eps]),
        "success": torch.tensor([e.success for e in eps]),
        "said": torch.tensor([float(getattr(p.env, "says_success", True))] * len(eps)),  # ever, this run
        "cut": torch.tensor([float(e.cut) for e in eps]),
        "observed": torch.tensor([float(e.observed) for e in eps]),
    }
    if p.job.rollout.tools or (p.chat is not None and p.chat.trl is not None):
        counts["tool_calls"] = torch.tensor([float(e.tool_calls) for e in eps])
        counts["tool_failures"] = torch.tensor([float(e.tool_failures) for e in eps])
    return Episodes(
        rollout=rollout,
        loss_mask=loss.to(device),
        prompts=prompts,
        transcripts=[tok.decode(e.tokens, skip_special_tokens=True) for e in eps],
        segments=[e.segments for e in eps],
        env_rewards=torch.tensor([e.reward for e in eps], dtype=torch.float32),
        counts=counts,
        logprobs=logprobs,
        columns=columns,
        conversation={"prompts": [e.said for e in eps], "completions": [e.messages for e in eps]}
        if p.chat is not None
        else None,
    )


def _truncated(p, e: _Episode) -> bool:
    """Whether the episode was cut: for tools on a data set TRL's `is_truncated` (its last token is not
    EOS: a turn cut by the budget, or tool results that filled it), else the episode's own end."""
    if p.chat is not None and p.chat.data is not None:
        return not e.tokens or e.tokens[-1] not in (p.tokenizer.eos_token_id, p.tokenizer.pad_token_id)
    return e.truncated


TOOL_COUNTS = ("tool_calls", "tool_failures")


def episode_stats(rt, e: Episodes) -> dict[str, float]:
    """Per generation batch over every rank: env/turns_mean, env/success_rate (the episodes whose env said
    `success: True` last, over all episodes: one that ends without saying is no success; NaN until some
    info of the run has had a `success` key), env/invalid_action_rate (per action),
    env/observation_cut_rate (per observation); with rollout.tools, TRL's tools/call_frequency (tool calls
    per episode) and tools/failure_frequency (per call). `timing/env` and `timing/tools` are the step
    clock's (monitor/timing.py)."""
    from gpufleet.dist import all_reduce_sum

    c = e.counts
    local = torch.tensor(
        [
            float(len(c["turns"])),
            float(c["turns"].sum()),
            float(c["invalid"].sum()),
            float(c["success"].sum()),
            float(c["said"].sum()),
            float(c["cut"].sum()),
            float(c["observed"].sum()),
            *[float(c[k].sum()) for k in TOOL_COUNTS if k in c],
        ]
    )
    n, turns, invalid, success, said_n, cut, obs, *tools = all_reduce_sum(rt, local).tolist()
    out = {
        "env/turns_mean": turns / max(n, 1),
        "env/success_rate": success / max(n, 1) if said_n else float("nan"),
        "env/invalid_action_rate": invalid / max(turns, 1),
        "env/observation_cut_rate": cut / max(obs, 1),
    }
    if tools:  # TRL's names: calls per episode, failures per call
        out["tools/call_frequency"] = tools[0] / max(n, 1)
        out["tools/failure_frequency"] = tools[1] / tools[0] if tools[0] else 0.0
    return out
