"""The job file: typed sections, each field with its default and a docstring.

A job file is YAML with the sections below; every field is optional (defaults are shown by
`gpufleet config JOB`). The docstring under each field is its documentation: `gpufleet config
--explain` and the README reference are generated from it. Cross-field rules (divisibility, devices,
model limits) live in `gpufleet/rules/`, not here: this module only knows types and ranges.

This module imports no torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.config.algorithm_section import AlgorithmSection
from gpufleet.config.env_section import EnvSection
from gpufleet.config.monitor_section import MonitorSection
from gpufleet.config.types import (  # noqa: F401  (re-exported: other modules import them from here)
    Command,
    DevicesOrAuto,
    FloatList,
    IdList,
    Mapping,
    RolePlacement,
    RolloutPlacement,
    Section,
    Size,
    StrList,
)


class ModelSection(Section):
    path: str = "builtin:tiny-qwen2"
    """Policy model: a Hugging Face hub id (`Qwen/Qwen2.5-0.5B-Instruct`), a local folder with a
    config.json, or `builtin:<name>` (tiny-qwen2, tiny-llama, small-qwen2), a tiny model gpufleet
    builds locally on first use (no download)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype the policy's weights are loaded and trained in. `auto`: float32 (master weights; bf16/fp16
    compute comes from autocast, see train.precision). `bfloat16`: pure bf16 weights and AdamW state,
    half the memory, no fp32 master copy."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""

    use_peft: bool = False
    """Train a LoRA adapter (peft) instead of every weight (TRL's name): the base model stays frozen,
    gradients and AdamW state exist only for the adapter, and the KL reference is the base model with
    the adapter switched off (no second copy). Checkpoints and `final/` hold the adapter;
    `gpufleet export --merge` writes the merged model."""

    lora_r: int = Field(16, ge=1)
    """LoRA rank (TRL's default)."""

    lora_alpha: int = Field(32, ge=1)
    """LoRA scaling: the update is (lora_alpha / lora_r) x B A (TRL's default)."""

    lora_dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout on the adapter's input (TRL's default). Its masks come from each rank's random stream, so
    with dropout N ranks match 1 rank in distribution, not bit for bit (0: exactly)."""

    lora_target_modules: StrList | None = None
    """Modules that get an adapter: names (`q_proj,v_proj`) or `all-linear`. None: peft's default
    for the architecture (q_proj and v_proj for Llama / Qwen / Mistral)."""


class DataSection(Section):
    path: str = "builtin:repeat"
    """Prompts: a local .jsonl / .json / .parquet / .csv file, or `builtin:<task>` (a generated task
    with its own reward functions)."""

    prompt_field: str = "prompt"
    """Column holding the prompt text. Other columns are passed to reward functions by name."""

    shuffle: bool = True
    """Shuffle the prompts (seeded by train.seed) each epoch."""


class RewardSection(Section):
    functions: StrList = Field(default_factory=list)
    """Reward functions: `module:function` import paths, called by keyword as TRL does:
    `fn(prompts=, completions=, completion_ids=, **columns) -> list[float | None]`, or built-in names
    (`repeat/match`). Empty with a `builtin:` dataset: that task's own rewards."""

    weights: FloatList | None = None
    """One weight per reward function (then one for `model`, if set). None: all 1.0."""

    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """How several rewards become one advantage (TRL's `multi_objective_aggregation`, same default):
    `sum_then_normalize` (weighted sum, then algorithm.scale_rewards), or `normalize_then_sum` (each
    function normalised within its group, then weighted, summed and divided by the batch std; GDPO,
    arXiv 2601.05242; scale_rewards plays no part)."""

    model: str | None = None
    """Optional reward model (sequence classification with one label): hub id or local folder."""

    timeout: float | None = Field(600.0, gt=0)
    """Seconds one call of a reward function (and the import of its module) may take before the run
    stops with a message naming the function and the sample. A "waiting for reward function ..." line
    is printed while a call takes longer than a few seconds. null: no limit."""


class RolloutSection(Section):
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: `hf` (built-in batched sampler with a KV cache). `vllm` is planned."""

    max_prompt_length: int = Field(512, ge=1)
    """Prompts longer than this many tokens are truncated from the left (check warns about a data file's
    longest prompts; train says it once at the first cut)."""

    max_completion_length: int = Field(256, ge=1)
    """Maximum new tokens per completion."""

    min_completion_length: int = Field(0, ge=0)
    """EOS is never sampled before this many completion tokens (Hugging Face `min_new_tokens`, vLLM
    `min_tokens`): it has probability 0 there in sampling and in every log-prob (trained, old,
    reference), so no completion stops early and EOS is never pushed down there. Saved into the model's
    `generation_config.json` as `min_new_tokens`. 0: off. Below max_completion_length; not for env jobs."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0 = greedy, which gives identical completions in a group)."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel degree of the rollout engine (vllm); must divide the attention and KV heads."""

    async_steps: int = Field(0, ge=0)
    """Generate ahead (needs placement.rollout device ids): the rollout ranks sample generation batch g + k
    while the policy trains on batch g, with the weights of k generation batches earlier (0: lock-step,
    each batch sampled with the current weights). Each batch records the weights it was sampled with
    (rollout/staleness) and its sampling log-probs (algorithm.importance_sampling_correction)."""

    tools: StrList | None = None
    """Python functions the policy may call (TRL's `tools`): `[module:function, path/to/file.py:function,
    ...]`, looked up like reward functions. Without an env section they run on the data set's prompts as
    TRL's tool loop does (chat episodes: the row's prompt, tool results as `tool` messages, the whole
    conversation within rollout.max_completion_length, scored by the reward functions); with an env they
    need env.format chat. Each is offered
    through the chat template with the JSON schema transformers' `get_json_schema` builds from its
    signature and docstring (type hints and an `Args:` section); a turn's tool calls are parsed with the
    tokenizer's response template (`parse_response`), run (async functions too) and answered as `tool`
    messages; an exception or rollout.tool_timeout becomes the result `{'error': ...}`, as in TRL."""

    max_tool_calling_iterations: int | None = Field(None, ge=0)
    """Tool-calling turns per episode at most (TRL's name and default: None, no limit other than
    env.max_turns, or rollout.max_completion_length without an env); a turn with tool calls past it goes
    to the environment as an ordinary action (without an env: it ends the episode, as in TRL)."""

    tool_timeout: float = Field(60.0, gt=0)
    """Seconds one tool call may take; past it the call's result is an error and the run goes on."""

    chat_template_kwargs: Mapping = Field(default_factory=dict)
    """Extra keyword arguments for the tokenizer's `apply_chat_template` (TRL's name), e.g.
    `{enable_thinking: false}`: in chat episodes, and for the prompts of chat-format data."""


class TrainSection(Section):
    per_device_batch: int = Field(8, ge=1)
    """Completions per policy rank per optimizer step: TRL's per_device_train_batch_size (one forward pass) x
    gradient_accumulation_steps."""

    global_batch: int | None = Field(None, ge=1)
    """Completions per optimizer step over all policy ranks, kept whatever the number of ranks: set it
    and per_device_batch is derived as global_batch / policy ranks (micro_batch, when unset, follows).
    Unset: per_device_batch x policy ranks, which grows with the rank count."""

    micro_batch: int | None = Field(None, ge=1)
    """Completions per forward/backward pass (TRL's per_device_train_batch_size); gradient accumulation
    (per_device_batch / micro_batch steps) makes up the rest. Unset: = per_device_batch (no accumulation)."""

    steps_per_generation: int = Field(1, ge=1)
    """Optimizer steps taken on each generation batch (it is split into this many parts). TRL counts its
    steps_per_generation in forward passes: gpufleet's = TRL's / gradient_accumulation_steps (TRL's default,
    = gradient_accumulation_steps, is 1 here)."""

    learning_rate: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""

    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""

    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps from 0 to learning_rate."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""

    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's beta1: the decay of its running mean of the gradients (TRL's name and default)."""

    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW's beta2: the decay of its running mean of the squared gradients (TRL's name and default; GRPO
    recipes often use 0.99)."""

    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the root of the squared-gradient mean (TRL's name and default)."""

    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 = no clipping)."""

    max_steps: int = Field(100, ge=1)
    """Optimizer steps to train."""

    seed: int = Field(42, ge=0, le=2**32 - 1)
    """Seed for initialisation, data order and sampling (sampling is seeded per prompt, not per rank); at
    most 2**32 - 1, as transformers' set_seed (numpy's seed) accepts."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: fp32, or bf16/fp16 with fp32 master weights (autocast; under FSDP over several
    ranks, FSDP2 mixed precision: parameters gathered in bf16/fp16, gradients reduced in fp32)."""

    torch_compile: bool = False
    """Compile each decoder layer of the policy and of the reference with torch.compile (TorchInductor,
    dynamic shapes: one compile serves every sequence length) for the training forward and backward and
    the scoring forwards; generation stays eager. The first step pays the compile (31 s for a 4-layer
    3.2M model on a 2-core CPU, whose later steps ran 7% faster: paid back after about 550 steps,
    bench/compile_payback.py); results equal eager's within float rounding, not bit for bit. On a CPU,
    TorchInductor needs a C++ compiler (g++, or $CXX)."""

    log_every: int = Field(1, ge=1)
    """Print a progress line every this many steps (metrics.jsonl always gets every step)."""

    samples_every: int = Field(10, ge=0)
    """Write a few prompts/completions/rewards to samples.jsonl every this many steps (0 = never)."""


class PlacementSection(Section):
    devices: DevicesOrAuto = "auto"
    """Device ids this job may use on each node (as numbered after CUDA_VISIBLE_DEVICES), or `auto`: all."""

    policy: DevicesOrAuto = "auto"
    """Devices of the policy ranks (one rank per device), or `auto`: every device not dedicated to
    another role, up to launch.nproc_per_node."""

    reference: RolePlacement = "auto"
    """Where the reference model lives: `colocate` (a copy on every policy rank), device ids (a
    dedicated scorer rank), or `auto` (colocate unless the planner decides otherwise)."""

    reward: RolePlacement = "auto"
    """Where the reward model lives: like `reference`. Roles placed on the same ids share one scorer rank."""

    rollout: RolloutPlacement = "colocate"
    """Where completions are generated: `colocate` (each policy rank samples its own rows) or device ids:
    a dedicated rollout rank on each, holding a copy of the policy that the policy ranks update after each
    optimizer step (the weights pushed over the process group, timed as `timing/weight_sync`), and
    generating the rows of the policy ranks it serves (policy rank i of a node: rollout device i mod
    their number). The same completions as colocated: the same per-completion seeds, the same weights."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Policy parallelism: DistributedDataParallel (a full replica per rank) or FSDP2 (sharded). Under
    FSDP over several ranks a colocated reference model and reward model are sharded the same way (1/N
    per rank)."""

    offload: Literal["none", "optimizer", "params"] = "none"
    """Keep training state in host (CPU) memory, FSDP on GPUs only (FSDP2's CPUOffloadPolicy, as verl's
    offload): `params` puts the sharded fp32 parameters, their gradients and the AdamW states in pinned
    host memory; the optimizer step runs on the CPU and each unit is copied to the GPU for its all-gather.
    `optimizer` is the same mechanism (FSDP2 cannot offload the optimizer states without their
    parameters), accepted for DeepSpeed users. `gpufleet plan` counts the host RAM per node."""

    allow_shared_devices: bool = False
    """Allow a dedicated scorer device to also hold a policy rank (two processes on one GPU)."""


class LaunchSection(Section):
    nproc_per_node: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    """Processes per node. `auto`: one per placed device (policy ranks + scorer ranks)."""

    nnodes: int = Field(1, ge=1)
    """Number of nodes. Inside a multi-node `srun` step: Slurm's node count (source `slurm`)."""

    node_rank: int = Field(0, ge=0)
    """This node's rank, 0 .. nnodes-1. Inside a multi-node `srun` step: this host's place in the step's
    node list (SLURMD_NODENAME), else $SLURM_NODEID."""

    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous for multi-node jobs (usually node 0's address). Inside a multi-node
    `srun` step: the node list's first host, port $MASTER_PORT or 29400 + job id % 1000."""

    master_addr: str = "127.0.0.1"
    """Address of rank 0 for single-node jobs."""

    master_port: Literal["auto"] | Annotated[int, Field(ge=1, le=65535)] = "auto"
    """TCP port of rank 0's store. `auto`: a free port chosen at launch."""

    rendezvous_timeout: int = Field(600, ge=1)
    """Seconds a node waits at the rendezvous for the other nodes of a multi-node job (torchrun's
    `join_timeout`). A node that never arrives makes the others stop with a message after this long."""

    max_restarts: int = Field(0, ge=0)
    """Times torchrun restarts all workers after a failure (each restart resumes from the last checkpoint)."""

    collective_timeout: int = Field(600, ge=10)
    """`gpufleet train`: seconds a collective (all-reduce, gather, a weight push) may wait before it fails;
    the rank that times out shows every rank's stack. `gpufleet launch`: seconds every rank of a script may
    stay silent before the run is treated as hung (every rank's stack dumped, every rank stopped, exit 1).
    A rank that dies does not make the others wait this long: torchrun stops them as soon as it sees it."""


class OutputSection(Section):
    dir: str = "runs/default"
    """Run directory: metrics.jsonl, samples.jsonl, logs/, checkpoints/, the final model."""

    resume: str = "auto"
    """`auto`: continue from the newest complete checkpoint in dir; `never`: refuse a dir that holds
    a run; or the path of a checkpoint to start from."""

    save_every: int = Field(50, ge=0)
    """Save a checkpoint every this many steps (0 = only at the end)."""

    keep_last: int = Field(2, ge=1)
    """Checkpoints to keep (older ones are deleted after a newer one is complete)."""


class ScriptSection(Section):
    """`gpufleet launch`: someone else's training script, and the recipe that worked for it."""

    command: Command = Field(default_factory=list)
    """The script's command line (`python train.py --batch_size {per_device_batch} --lr {learning_rate}`),
    one string or a list; `gpufleet launch JOB -- CMD ...` gives it on the command line instead.
    Placeholders: {per_device_batch} {gradient_accumulation_steps} {effective_batch} {learning_rate}
    {max_steps} {nproc} {world_size} {output_dir}; the same values reach the script as GPUFLEET_* variables."""

    reference_devices: int = Field(1, ge=1)
    """The device count the recipe below worked on (what the hand-tuned single-GPU command used)."""

    per_device_batch: int | None = Field(None, ge=1)
    """Per-device batch of the reference recipe. None: the script keeps its own (no batch scaling)."""

    gradient_accumulation_steps: int = Field(1, ge=1)
    """Gradient accumulation of the reference recipe (HF/TRL's name)."""

    learning_rate: float | None = Field(None, gt=0)
    """Learning rate of the reference recipe. None: the script keeps its own."""

    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps of the reference recipe; scaled so the run sees the same number of samples."""

    batch_rule: Literal["keep_effective_batch", "keep_per_device_batch"] = "keep_effective_batch"
    """How the batch follows the device count: keep the effective batch (per-device batch x accumulation
    x devices, the recipe's optimisation unchanged) or keep the per-device batch (the effective batch
    grows with the devices)."""

    lr_rule: Literal["none", "linear", "sqrt"] = "none"
    """How the learning rate follows the effective batch: unchanged, x ratio (Goyal et al.), or
    x sqrt(ratio) (Adam-style). With keep_effective_batch the ratio is 1 and this changes nothing."""

    memory_per_device: Size | None = None
    """GPU memory one rank needs at its peak (`20GB`; GB means GiB, as in --gpus), checked against each
    chosen GPU's free memory (NVML) — or its size, for a --gpus what-if — before anything starts.
    None: not checked."""

    progress_regex: str = r"gpufleet-progress samples=(\d+)"
    """A line of rank 0's output that reports progress (for `launch --scaling`): a regular expression whose
    first group is the number of samples processed so far over all ranks. The default matches what
    `gpufleet.progress.report(samples)` prints."""


class Job(BaseModel):
    """A whole job: one section per concern."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    env: EnvSection = Field(default_factory=EnvSection)
    train: TrainSection = Field(default_factory=TrainSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    output: OutputSection = Field(default_factory=OutputSection)
    script: ScriptSection = Field(default_factory=ScriptSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)

    def roles_used(self) -> dict[str, bool]:
        """Whether the reference and reward roles have anything to hold (the one place this is decided):
        a reference model only when the KL term is on (beta > 0) and the policy is not a LoRA adapter
        (then the reference is the base model inside the policy), a reward model only when one is named."""
        reference = self.algorithm.beta > 0 and not self.model.use_peft
        return {"reference": reference, "reward": self.reward.model is not None}

    def completion_tokens(self) -> int:
        """Tokens after the prompt of one trained sequence: an episode's budget with an env, else
        rollout.max_completion_length."""
        return self.env.episode_tokens() if self.env.name else self.rollout.max_completion_length

    def generation_batch(self, policy_ranks: int) -> int:
        """Completions sampled per generation round over all policy ranks (the one place this is computed):
        per_device_batch x policy ranks x steps_per_generation."""
        t = self.train
        return t.per_device_batch * policy_ranks * t.steps_per_generation


SECTIONS: dict[str, type[Section]] = {
    name: info.default_factory  # type: ignore[misc]
    for name, info in Job.model_fields.items()
}


def field_paths() -> list[str]:
    """Every `section.field` name, in file order."""
    return [f"{s}.{f}" for s, cls in SECTIONS.items() for f in cls.model_fields]


def field_doc(path: str) -> str:
    """The docstring of `section.field`, folded to one paragraph."""
    section, field = path.split(".", 1)
    return " ".join((SECTIONS[section].model_fields[field].description or "").split())
