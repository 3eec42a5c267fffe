"""The `env:` section of a job file (multi-turn agent RL), split from schema.py for size; schema.py's
`Job` holds it like every other section."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gpufleet.config.types import Mapping, Section, StrList


class EnvSection(Section):
    """Multi-turn agent RL: the policy acts in an environment for several turns (`gpufleet train`).
    Unset `name`: single-turn prompt -> completion from `data`."""

    name: str | None = None
    """The environment: `builtin:keys`, `gymnasium:<id>` (a Gymnasium env with a discrete action space,
    e.g. `gymnasium:FrozenLake-v1`, through a text adapter), or your class as `module:Class` /
    `path/to/file.py:Class` with `reset(seed=) -> (observation, info)` and `step(action) -> (observation,
    reward, terminated, truncated, info)` over text; or a TRL environment class (TRL 1.16's
    environment_factory: a `reset` method and no `step`; its methods are its tools; env.format chat) or a
    dict of them by name (`file.py:DICT`; each data row's `environment` column picks one). Each episode's
    reset seed comes from train.seed and its group; the G episodes of a group share it. With an env,
    `data` is not read, except by a TRL environment class (a file or hub dataset: TRL's
    train_dataset, its rows reset's keyword arguments). An `info` may say
    `success` (bool): the metric env/success_rate is the share of a generation batch's episodes whose
    last `success` was True -- an episode that ends without saying is no success -- and is NaN until
    some info of the run has had the key (an env that never says has no rate, not 0)."""

    format: Literal["text", "chat"] = "text"
    """How an episode is laid out for the policy. `text`: the first observation is the prompt and each
    observation's tokens follow the action as they are. `chat`: the model's chat template lays it out --
    the first observation as a user message (with rollout.tools offered), each action as an assistant
    message, each observation as a user message and each tool result as a tool message; the tokens
    between two actions come from the template (as TRL's `_get_tool_suffix_ids`), never from
    re-tokenising the history, so the trained tokens are exactly the sampled ones. The environment gets
    each action's message content (tool calls parsed out). Needs a prefix-preserving chat template
    (checked by `gpufleet check`)."""

    kwargs: Mapping = Field(default_factory=dict)
    """Keyword arguments for the environment's constructor (for gymnasium: those of `gymnasium.make`,
    e.g. `{is_slippery: false}`)."""

    servers: Literal["auto"] | Annotated[int, Field(ge=0)] = "auto"
    """Environment server processes gpufleet starts for the run (127.0.0.1, a fresh token per run,
    restarted if one dies): `auto` = one per policy device (VAGEN's layout), N, or 0 = the environments
    run inside each trainer process (no server)."""

    address: StrList | None = None
    """Servers someone else runs, as `[host:port, ...]`: gpufleet starts none and spreads episodes over
    these (`python -m gpufleet.env.server` serves any env). Needs env.token_file."""

    token_file: str | None = None
    """File holding the token the servers at env.address require (first line). Relative to the job
    file's folder. gpufleet's own servers get a random token per run, in OUTPUT/env/token."""

    max_turns: int = Field(8, ge=1)
    """Policy turns per episode at most; an episode still running then is truncated."""

    max_action_tokens: int = Field(16, ge=1)
    """Tokens the policy writes per turn at most; a turn also ends at the tokenizer's EOS token."""

    max_observation_tokens: int = Field(256, ge=1)
    """Tokens kept of each observation (its first ones; longer observations are cut, counted in the
    metric env/observation_cut_rate)."""

    max_episode_tokens: int | None = Field(None, ge=1)
    """Token budget of an episode after the first prompt (actions + observations): an episode that
    would go past it is truncated. None: max_turns x (max_action_tokens + max_observation_tokens).
    The trained sequence is rollout.max_prompt_length + this."""

    reset_timeout: float = Field(600.0, gt=0)
    """Seconds making one environment may take, and then its `reset(seed=)` (each), in a server or in the
    trainer (env.servers: 0). From a few seconds on the run says which call it waits for ("waiting for
    Sokoban.reset (episode g0r3, seed 12) for 5 s"); past this limit it stops with one line naming the
    class, the method, the episode, the server and the file:line where the environment is stuck. Raise
    it for an environment whose reset legitimately takes minutes (a simulator that boots)."""

    step_timeout: float = Field(600.0, gt=0)
    """Seconds one `step(action)` (or `close()`) may take; as env.reset_timeout (the action is quoted)."""

    instructions: str | None = None
    """Text put before the first observation. None: the environment's own `instructions`."""

    reward_weight: float = 1.0
    """Weight of the environment's reward (the sum over the episode's turns) in the episode reward;
    reward.functions (scored on the whole transcript) and their reward.weights add to it."""

    def episode_tokens(self) -> int:
        """The episode's token budget after the first prompt (the one place this is computed)."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_turns * (self.max_action_tokens + self.max_observation_tokens)
