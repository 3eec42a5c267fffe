"""Reward functions and reward models: resolve them, call them, and refuse bad answers clearly.

A reward function is called as TRL 1.16 calls it, every argument by keyword (`usercode.call_reward`):
`fn(prompts=, completions=, completion_ids=, **columns) -> list[float | None]`, the other dataset
columns as keyword lists; None means "not applicable to this sample" and becomes NaN, which the
weighted sum ignores (`advantages.combine_rewards`). In chat episodes (env.format chat, tools on a data
set) the functions get TRL's conversational forms: each prompt a list of messages, each completion the
list of messages after it (assistant turns as parsed, with their `tool_calls`; `tool` results; an
environment's `user` observations); so do single-turn jobs whose data prompts are chat messages
(`chat_said`: the completion is the one assistant message). A reward model still scores the text.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpufleet.config.schema import RewardSection
from gpufleet.dist import Runtime
from gpufleet.errors import UserError
from gpufleet.rl.chat import parse_response
from gpufleet.rl.rewardlog import RewardLog
from gpufleet.text import plural
from gpufleet.usercode import call_reward, import_function, reward_columns
from gpufleet.watchdog import Overdue, deadline, innermost_locals, where_stuck


def resolve_function(
    name: str, timeout: float | None = None, columns: Sequence[str] | None = None, passes: Sequence[str] = ()
) -> Callable:
    """A built-in reward name (`task/fn`) or a `module:function` import path, bound as `gpufleet check`
    binds it: its signature checked against the data's `columns` (`usercode.reward_columns`)."""
    from gpufleet import tasks

    if ":" not in name:
        try:
            return tasks.builtin_reward(name)
        except ValueError as e:
            raise UserError(
                str(e), field="reward.functions", fix="use module:function or a built-in name"
            ) from None
    return import_function(name, columns, timeout=timeout, passes=passes)


class RewardModel:
    """A sequence-classification model with one label, scoring prompt + completion text.

    Frozen and loaded in `dtype` (the job's compute dtype: config/precision.py `reward_model_dtype`).
    With `shard` (FSDP over several policy ranks, the reward model colocated) it is sharded like the
    reference (parallel.py `shard_frozen`): 1/N of its weights per policy rank, each layer gathered for
    its forward; every policy rank must then score the same number of texts (it does: each holds
    `per_device_batch x steps_per_generation` rows), so they run the same number of forwards together."""

    def __init__(
        self,
        path: str,
        device: torch.device,
        batch_size: int = 16,
        dtype: str = "float32",
        shard: Runtime | None = None,
    ):
        from transformers import AutoModelForSequenceClassification

        from gpufleet.models import load_tokenizer, resolve_model_path

        resolved = resolve_model_path(path, "reward.model")
        self.tokenizer = load_tokenizer(path, field="reward.model")
        model = AutoModelForSequenceClassification.from_pretrained(resolved, dtype=getattr(torch, dtype))
        if model.config.num_labels != 1:
            raise UserError(
                f"reward model {path} has {model.config.num_labels} labels.",
                field="reward.model",
                fix="use a sequence-classification model with num_labels=1",
            )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        model.requires_grad_(False)
        if shard is not None:  # loaded on the CPU; fully_shard moves each unit's shard to the device
            from gpufleet.parallel import shard_frozen

            model = shard_frozen(model, shard)
        else:
            model = model.to(device)
        self.model = model.eval()
        self.device, self.batch_size = device, batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        from gpufleet.parallel import release

        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[i : i + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            out.extend(self.model(**enc).logits[:, 0].float().tolist())
        release(self.model)  # sharded: the root unit gathered no longer
        return out


class Rewards:
    """All reward sources of a job, in order: the environment's (an env job), the functions, then the
    model. `labels` name them in the metrics."""

    def __init__(
        self,
        cfg: RewardSection,
        default_names: list[str],
        device: torch.device,
        model_here: bool = True,
        env_weight: float | None = None,
        model_dtype: str = "float32",
        shard: Runtime | None = None,
        columns: Sequence[str] | None = None,
        passes: Sequence[str] = (),
    ):
        """`model_dtype`, `shard`: how the reward model is loaded (`RewardModel`); `columns`: the data
        columns the functions get (`usercode.reward_columns`; None: unknown), checked against their
        signatures here as `gpufleet check` does; `passes`: TRL's `environments` when the job passes it."""
        names = list(cfg.functions) or ([] if env_weight is not None else list(default_names))
        self.fns: list[Callable | None] = [resolve_function(n, cfg.timeout, columns, passes) for n in names]
        self.names = [n.split(":")[-1].split("/")[-1] if ":" in n else n.replace("/", "_") for n in names]
        if cfg.model:
            # None: the reward model lives on a dedicated scorer rank, its scores arrive with the batch.
            rm = RewardModel(cfg.model, device, dtype=model_dtype, shard=shard) if model_here else None
            self.fns.append(rm)
            self.names.append("reward_model")
        if not self.fns and env_weight is None:
            raise UserError(
                "no reward function or model.",
                field="reward.functions",
                fix="--set reward.functions=module:function",
            )
        weights = cfg.weights if cfg.weights is not None else [1.0] * len(self.fns)
        if len(weights) != len(self.fns):
            raise UserError(
                f"{plural(len(weights), 'weight')} for {plural(len(self.fns), 'reward')}.",
                field="reward.weights",
                fix=f"give {plural(len(self.fns), 'weight')}",
            )
        self.env = env_weight is not None
        self.timeout = cfg.timeout
        self.weights = torch.tensor(([env_weight] if self.env else []) + list(weights), dtype=torch.float32)
        self.labels = (["env"] if self.env else []) + self.names

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        model_scores=None,
        env_rewards: torch.Tensor | None = None,
        completion_ids: list[list[int]] | None = None,
        log: RewardLog | None = None,
        conversation: dict[str, list] | None = None,
    ) -> torch.Tensor:
        """(N, F) float tensor; NaN where a function returned None. `model_scores`: from a scorer rank;
        `env_rewards`: the episodes' environment rewards (first column of an env job); `completion_ids`:
        each completion's token ids, for the functions' `completion_ids`; `log`: TRL's `trainer_state`,
        `log_metric`, `log_extra` for the functions that take them; `conversation`: the TRL arguments of
        chat episodes and of chat-data single-turn batches (`chat_said`) -- `prompts` and `completions` as
        message lists, which the functions get instead of the text, and `environments` (TRL environment
        instances in this process), for the functions that take it."""
        logging = log.keywords() if log is not None else None
        trl = dict(conversation or {})
        said = (trl.pop("prompts"), trl.pop("completions")) if trl else None
        if trl:  # environments: passed like the logging keywords, to the functions that take them
            logging = {**(logging or {}), **trl}
        cols = {k: columns[k] for k in reward_columns(columns)}
        out = torch.empty(len(completions), len(self.labels), dtype=torch.float32)
        if self.env:
            out[:, 0] = env_rewards
        for j, (fn, label) in enumerate(zip(self.fns, self.names, strict=True), start=int(self.env)):
            texts = (prompts, completions) if said is None or isinstance(fn, RewardModel) else said
            values = (
                model_scores
                if fn is None
                else _call_checked(fn, label, *texts, cols, self.timeout, completion_ids, logging)
            )
            out[:, j] = torch.tensor(values, dtype=torch.float32)
        return out


def completion_token_ids(rollout) -> list[list[int]]:
    """Each completion's token ids, TRL's `completion_ids`: the tokens under the completion mask, EOS
    included when generated (an env job: the transcript's tokens)."""
    ids, mask = rollout.completion_ids.cpu(), rollout.completion_mask.cpu().bool()
    return [row[m].tolist() for row, m in zip(ids, mask, strict=True)]


def chat_said(
    p, row_pos: list[int], rollout, prompts: list[str], completions: list[str], raw: list | None = None
) -> dict | None:
    """TRL's reward arguments `prompts` and `completions` of a single-turn batch (no env, no tools) whose
    data prompts are chat messages (TRL's `is_conversational`), as TRL 1.16's `_generate` builds them: each
    prompt the row's messages (a copy), each completion a list of one assistant message -- the sampled ids
    parsed with the tokenizer's response template after the rendered prompt (rl/chat.py `parse_response`,
    TRL's), or `{"role": "assistant", "content": text}` for a tokenizer without one. None when no row's
    prompt is messages: text data passes the text. A text row among chat rows keeps its text."""
    field = p.source.field
    if raw is None:  # the rows' prompts as the data holds them (the step passes those it read)
        raw = [p.source.examples(pos, 1)[0][field] for pos in row_pos]
    chat = [isinstance(x, list) and bool(x) and isinstance(x[0], dict) and "role" in x[0] for x in raw]
    if not any(chat):
        return None
    ids = completion_token_ids(rollout)
    heads = rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu().bool()
    said: dict[str, list] = {"prompts": [], "completions": []}
    for i, (messages, is_chat) in enumerate(zip(raw, chat, strict=True)):
        if not is_chat:
            said["prompts"].append(prompts[i])
            said["completions"].append(completions[i])
            continue
        prefix = heads[0][i][heads[1][i]].tolist()
        said["prompts"].append(copy.deepcopy(messages))
        said["completions"].append([parse_response(p.tokenizer, ids[i], prefix)])
    return said


def _call_checked(
    fn,
    label: str,
    prompts,
    completions,
    cols,
    timeout: float | None = None,
    completion_ids=None,
    logging=None,
) -> list[float]:
    """Call one reward function (`usercode.call_reward`, under `timeout`, see gpufleet.watchdog); any
    failure names the function and the first offending sample."""
    n = len(completions)
    try:
        with deadline(f"reward function {label} ({n} samples)", timeout):
            values = call_reward(fn, prompts, completions, completion_ids, cols, logging)
    except Overdue as e:
        raise _overdue(label, timeout, e, prompts, completions) from None
    except SystemExit as e:
        raise UserError(
            f"reward function {label} called sys.exit({e.code!r}).",
            field="reward.functions",
            fix="return a float or None per completion instead of exiting",
        ) from None
    except Exception as e:  # user code: find the first sample it fails on, then report it in one line
        # (not a reward model: sharded, it may only run as often as on the other ranks)
        i = (
            None
            if isinstance(fn, RewardModel)
            else _first_failing(fn, prompts, completions, cols, timeout, completion_ids, logging)
        )
        where = f" on {_sample(i, prompts, completions)}" if i is not None else ""
        line = where_stuck(e)  # the line of the user's code that raised
        raise UserError(
            f"reward function {label} raised {type(e).__name__}: {e}{f' at {line}' if line else ''}{where}.",
            field="reward.functions",
            fix=(
                "the function's own error says what it lacked: fix the function, or give it the data "
                "it needs (it must return a float or None for every completion)"
            ),
        ) from None
    if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
        raise UserError(
            f"reward function {label} returned {type(values).__name__}, not a list.",
            field="reward.functions",
            fix=f"return a list of {n} floats (None = not applicable)",
        )
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != n:
        raise UserError(
            f"reward function {label} returned {len(values)} values for {n} completions.",
            field="reward.functions",
            fix="return one value per completion, in order",
        )
    result = []
    for i, v in enumerate(values):
        x = _real(v)
        if x is None:
            raise UserError(
                f"reward function {label} returned {v!r} for {_sample(i, prompts, completions)}.",
                field="reward.functions",
                fix="return a finite float, or None when the reward does not apply",
            )
        result.append(x)
    return result


def _real(v) -> float | None:
    """A reward value as a float (None -> NaN): any real number type, as TRL takes them (Python and
    numpy numbers and bools -- TRL's torch.tensor(..., dtype=float32) makes True 1.0 --, 0-d tensors and
    arrays); None for what is not a finite real number."""
    if v is None:
        return math.nan
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # np.float32(0.5), torch.tensor(0.5), np.bool_
        v = v.item()
    if not isinstance(v, numbers.Real):  # bool is a Real (an int): True -> 1.0
        return None
    x = float(v)
    return x if math.isfinite(x) else None


def _sample(i: int, prompts, completions) -> str:
    return f"sample {i} (prompt {_clip(prompts[i])}, completion {_clip(completions[i])})"


def _clip(text, limit: int = 120) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 5] + "...'"


def _overdue(label: str, timeout, e: Overdue, prompts, completions) -> UserError:
    """The timeout error: the sample the function was at (a local variable holding that very
    completion string) and the line of the user's code it was on."""
    ids = {id(c): i for i, c in enumerate(completions)}
    at_sample = next(
        (ids[id(v)] for frame in innermost_locals(e) for v in frame.values() if id(v) in ids),
        None,
    )
    if at_sample is not None:
        what = _sample(at_sample, prompts, completions)
    else:
        what = f"a batch of {len(completions)} samples (the first: {_sample(0, prompts, completions)})"
    at = where_stuck(e)
    return UserError(
        f"reward function {label} did not return within {timeout:g} s (reward.timeout) on {what}"
        + (f"; it was at {at}." if at else "."),
        field="reward.functions",
        fix=f"make it faster (or return None where it cannot decide), or raise the limit: "
        f"--set reward.timeout={max(2 * timeout, 60):g}",
    )


def _first_failing(
    fn, prompts, completions, cols, timeout: float | None, completion_ids=None, logging=None
) -> int | None:
    try:
        with deadline("reward function (looking for the sample it fails on)", timeout):
            for i in range(len(completions)):
                try:
                    call_reward(
                        fn,
                        prompts[i : i + 1],
                        completions[i : i + 1],
                        None if completion_ids is None else completion_ids[i : i + 1],
                        {k: v[i : i + 1] for k, v in cols.items()},
                        logging,
                    )
                except Exception:  # looking for the failing sample; the error itself was already caught
                    return i
    except (Overdue, SystemExit):  # the first error is the one to report
        return None
    return None
