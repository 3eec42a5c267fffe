"""What the RL loop works with, built once: the models, the tokenizer, the prompts, the rewards, the loss."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpufleet.config.schema import Job
from gpufleet.dist import Runtime, all_true
from gpufleet.engine.compiled import compile_layers, eager
from gpufleet.engine.rollout import Rollout, Sampling
from gpufleet.engine.sampling import mark_generation_config
from gpufleet.rl import rollouts, trlenv
from gpufleet.rl.data import PromptSource
from gpufleet.rl.entropy import EntropyControl
from gpufleet.rl.losses import Loss
from gpufleet.rl.precision import (
    decode_dtype,
    fsdp_param_dtype,
    model_dtype,
    reference_dtype,
    reward_model_dtype,
)
from gpufleet.rl.rewards import Rewards
from gpufleet.rl.tooldata import NoEnv, tools_on_data


@dataclass
class Parts:
    """Everything the loop needs, built once by `build`."""

    job: Job
    rt: Runtime
    policy: torch.nn.Module  # the plain model (generation, saving)
    train_model: torch.nn.Module  # what the loss goes through: the policy, its DDP wrapper, or FSDP
    reference: torch.nn.Module | None  # colocated reference model (None: not used, or on a scorer)
    tokenizer: object
    source: PromptSource | None  # None with an env: the environments give the prompts
    rewards: Rewards
    loss: Loss
    env: object | None = None
    """With an env: this rank's way to its environments (env/client.py `EnvPool` or `LocalPool`)."""
    suppress_tokens: tuple[int, ...] = ()
    """Token ids the policy never samples nor scores (engine/sampling.py `never_sampled`: a pad that is not EOS)."""
    entropy: EntropyControl = field(default_factory=EntropyControl)
    """The entropy bonus's coefficient and adaptive controller (its state goes into checkpoints)."""
    pending_ref_mixes: list = field(default_factory=list)
    """(alpha, policy parameters) of reference syncs not yet sent to the scorer rank (rl/refsync.py)."""
    remote: rollouts.RemoteRollout | None = None
    """This rank's dedicated rollout rank (rl/rollouts.py), or None: it samples its own rows."""
    chat: object | None = None
    """env.format chat: the run's chat layout and tools (rl/chatturns.py `ChatRun`), built on first use."""

    @property
    def device(self) -> torch.device:
        return self.rt.device

    @functools.cached_property
    def router_aux(self) -> float:
        """The weight of a Mixture-of-Experts policy's router load-balancing loss (0: none; TRL's rule,
        models/info.py `router_aux_coef`)."""
        from gpufleet.errors import UserError
        from gpufleet.models.info import router_aux_coef

        try:
            return router_aux_coef(self.job.algorithm.router_aux_loss_coef, self.policy.config.to_dict())
        except ValueError as e:  # check refuses it first (rules/algorithm.py)
            raise UserError(f"{e}.", field="algorithm.router_aux_loss_coef", fix="remove it (or 0)") from e

    @property
    def early(self) -> tuple[int | None, int]:
        """(EOS id, rollout.min_completion_length): EOS has probability 0 before that many tokens."""
        return self.tokenizer.eos_token_id, self.job.rollout.min_completion_length

    @property
    def sampling(self) -> Sampling:
        """The job's sampling settings, as the engine takes them."""
        ro = self.job.rollout
        return Sampling(
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            suppress_tokens=self.suppress_tokens,
            min_new_tokens=ro.min_completion_length,
            decode_dtype=decode_dtype(self.job, self.device),
        )


def build(
    job: Job, rt: Runtime | None = None, weights: Path | None = None, run_dir: Path | None = None
) -> Parts:
    """Load everything; `weights`: a checkpoint folder to take the policy weights from (resume);
    `run_dir`: the output folder (where gpufleet's environment servers are listed)."""
    from transformers.utils import logging as hf_logging

    from gpufleet.models import load_tokenizer

    rt = rt or Runtime()
    hf_logging.disable_progress_bar()
    torch.manual_seed(job.train.seed)
    tokenizer = load_tokenizer(job.model.path)
    policy, train_model, reference = _models(job, rt, weights)
    env = source = None
    if job.env.name:
        from gpufleet.env.connect import open_pool

        env = open_pool(job, rt, run_dir or Path(job.output.dir))
    else:
        source = PromptSource(job.data, job.train.seed)
    if tools_on_data(job):  # TRL's tools on a data set: chat episodes with no environment (rl/tooldata.py)
        env = NoEnv()
    rewards = Rewards(
        job.reward,
        source.reward_names() if source else [],
        rt.device,
        model_here=not rt.dedicated("reward"),
        env_weight=job.env.reward_weight if job.env.name else None,
        model_dtype=reward_model_dtype(job),
        shard=rt if sharded(job, rt) else None,  # FSDP: 1/N of the reward model per policy rank
        columns=source.reward_columns() if source else trlenv.reward_columns(job),  # a TRL env's data
        passes=trlenv.passes(job),  # TRL's environments (in process)
    )
    loss = Loss.from_job(job)
    suppress_tokens = mark_generation_config(tokenizer, policy, job.rollout.min_completion_length)
    parts = Parts(
        job,
        rt,
        policy,
        train_model,
        reference,
        tokenizer,
        source,
        rewards,
        loss,
        env,
        suppress_tokens,
        EntropyControl.from_job(job),
        remote=rollouts.connect(rt, job),
    )
    parts.router_aux  # noqa: B018 -- a weight for a model without a router: one line now, not a step later
    return parts


def _models(
    job: Job, rt: Runtime, weights: Path | None
) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module | None]:
    """(policy, the module trained: the policy or its DDP / FSDP wrapper, the colocated reference or None)."""
    from gpufleet.models import load_causal_lm

    peft = job.model.use_peft  # LoRA: the base from model.path, the adapter from the checkpoint
    base = job.model.path if peft else str(weights or job.model.path)
    # Under FSDP the model loads on the CPU and fully_shard moves each unit to the device as it shards
    # it: a GPU never holds the whole model (a 7B in fp32 is 30 GB).
    load_on = "cpu" if sharded(job, rt) else str(rt.device)
    policy = load_causal_lm(base, dtype=model_dtype(job), device=load_on)
    if peft:
        from gpufleet.models import lora

        policy = lora.apply(policy, job.model, adapter=weights)
    if job.model.gradient_checkpointing:
        # transformers 5.x: activation_checkpointing_enable (gradient_checkpointing_enable is deprecated)
        policy.activation_checkpointing_enable({"use_reentrant": False})
    if job.train.torch_compile:
        compile_layers(policy)  # before DDP / fully_shard wrap it
    train_model = policy
    if rt.distributed and rt.policy_size > 1:
        from gpufleet.parallel import wrap_policy

        pl = job.placement
        dtype = fsdp_param_dtype(job, rt.policy_size)
        train_model = wrap_policy(policy, pl.strategy, rt, dtype, pl.offload)
    reference = None
    if job.roles_used()["reference"] and not rt.dedicated("reference"):
        reference = load_reference(job, load_on)
        if sharded(job, rt):  # 1/N of the reference per policy rank
            from gpufleet.parallel import shard_frozen

            reference = shard_frozen(reference, rt)
    return policy, train_model, reference


def load_reference(job: Job, device: str) -> torch.nn.Module:
    """The frozen reference model (model.path, reference dtype) on `device`, compiled with
    train.torch_compile."""
    from gpufleet.models import load_causal_lm

    reference = load_causal_lm(job.model.path, dtype=reference_dtype(job), device=device).eval()
    reference.requires_grad_(False)
    if job.train.torch_compile:
        compile_layers(reference)
    return reference


def sharded(job: Job, rt: Runtime) -> bool:
    """FSDP2 over several policy ranks: the policy is sharded, and so are a colocated reference and reward
    model."""
    return rt.distributed and rt.policy_size > 1 and job.placement.strategy == "fsdp"


def sample(p: Parts, prompt_ids: list[list[int]], seeds: list[int], max_new_tokens: int) -> Rollout:
    """One completion per row (row i's randomness from seeds[i]). Under FSDP the ranks generate through
    the sharded model, together (every rank must call this the same number of times)."""
    rt = p.rt
    fsdp = sharded(p.job, rt)
    with eager(p.job.train.torch_compile):
        rollout = p.sampling.generate(
            p.train_model if fsdp else p.policy,
            prompt_ids,
            seeds,
            max_new_tokens,
            all_done=(lambda flag: all_true(rt, flag)) if fsdp else None,
        )
    return rollout.to(p.device)
