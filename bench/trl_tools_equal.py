"""TRL 1.16 parity of chat episodes with tools and of chat-data reward arguments (run by trl_grad_equal.py).

    python bench/trl_grad_equal.py            # its third and fourth parts are these

Tool calling (`compare_tool_loop`): 3 groups of G=4 conversations with forced turns (TOOL_TURNS, TRL's
`tools=[k]`): TRL's `_generate_and_score_completions` with only its `_generate_single_turn` forced (its own
`_tool_call_loop`, `_get_tool_suffix_ids`, `parse_response`) against gpufleet's chat episodes
(`episodes.play`, `_act` forced): prompt ids, completion ids, loss mask (TRL's completion_mask * tool_mask)
per row, then the gradient. The third group sits at the end of max_completion_length: tool results that
exactly fill it (one call, two calls), one token over it (dropped), one token short of it.
Chat-data rewards (`compare_chat_rewards`): a single-turn batch on chat-format prompts, no tools, forced
completions: the `prompts` and `completions` TRL's reward function gets vs gpufleet's (`rewards.chat_said`).
"""

from __future__ import annotations

import copy

from trl_grad_equal import G, gpufleet_side, trl_side

TOOL_P = 3  # groups in the tool case

# The tool-calling case: env builtin:vault, its tool `k` (src/gpufleet/env/vault.py) as TRL's tools=[k].
TOOL_TURNS = [  # per row: the policy's first turn, then its turn after the tool results ("<eos>" ends a turn)
    ("[k n={n}]<eos>", "{k}<eos>"),  # the right call, then its key
    ("[k n={n}]", "{k}z<eos>"),  # a call cut without EOS (the turn's token limit)
    ("[k n=12]<eos>", "q<eos>"),  # a failing call: its error is the tool's result
    ("[k n={n}][k n=3]<eos>", "ab<eos>"),  # two calls in one turn: two tool messages
    ("b<eos>", None),  # no call: the turn is the answer
    ("[k n={n}]<eos>", "[k n={n}]<eos>"),  # a call after the last tool-calling iteration: not run
    ("x [k n={n}]<eos>", "{k}<eos>"),  # text before the call
    ("[nope]<eos>", "c<eos>"),  # an unknown tool
    ("{pad}[k n={n}]<eos>", "{k}<eos>"),  # its result exactly fills the budget: kept, nothing after
    ("{pad}[k n={n}]<eos>", None),  # its result 1 token past the budget: dropped (TRL samples no more)
    ("{pad}[k n={n}]<eos>", "{k}<eos>"),  # its result 1 token short: kept, 1 token of the answer
    ("{pad}[k n={n}][k n=3]<eos>", "ab<eos>"),  # two results exactly fill the budget
]
FILL = {8: 0, 9: 1, 10: -1, 11: 0}  # rows padded ("x"s) so the call and its results end there (+-)
TOOL_LENGTH = 96  # TRL's max_completion_length = gpufleet's env.max_episode_tokens


def forced_ids(tok, text: str) -> list[int]:
    """`text` as the policy would sample it: one token per character (spaces too), EOS for "<eos>"."""
    body = text.removesuffix("<eos>")
    ids = tok.convert_tokens_to_ids(list(body))
    return ids + ([tok.eos_token_id] if text.endswith("<eos>") else [])


def tool_turns(tok, observations: list[str]) -> list[list[list[int]]]:
    from gpufleet.env.vault import k

    out = []
    for row, (first, second) in enumerate(TOOL_TURNS):
        n = int(observations[row][0])  # the vault number, shown SHOWN times ("77777777:")
        call = first.format(n=n, pad="")
        # the built-in template's tool bridge (models/chat.py): "T:<result>\n" per call, then "A:"
        bridge = sum(len(f"T:{k(m)}\n") for m in (n, 3)[: call.count("[k")]) + len("A:")
        pad = "x" * (TOOL_LENGTH + FILL[row] - len(forced_ids(tok, call)) - bridge) if row in FILL else ""
        turns = [first] + ([second] if second else [])
        out.append([forced_ids(tok, t.format(n=n, k=k(n), pad=pad)) for t in turns])
    return out


def gpufleet_tool_episodes(parts):
    """gpufleet's episodes of the 12 rows (3 groups of G), their turns forced after sampling's place."""
    from gpufleet.rl import episodes

    turns: dict[str, list[list[int]]] = {}

    def act(p, live, turn, budget):
        if not turns:  # the first turn: every row is live, in order
            observations = [p.tokenizer.decode(e.prompt).split("U:")[-1].split("\n")[0] for e in live]
            turns.update(zip([e.id for e in live], tool_turns(p.tokenizer, observations), strict=True))
        eos, out = p.tokenizer.eos_token_id, []
        for e in live:  # cut to what is left of the budget, as `_act`
            t = turns[e.id][turn][: max(budget - len(e.tokens), 0)]
            out.append((t, p.tokenizer.decode([i for i in t if i != eos])))
        return out

    real, episodes._act = episodes._act, act
    try:
        rows = list(range(TOOL_P * G))
        return episodes.play(parts, rows, [r // G for r in rows], rows, gen_index=0), turns
    finally:
        episodes._act = real


def trl_tool_batch(trainer, prompts: list[str], turns: dict):
    """TRL 1.16's own `_generate_and_score_completions` with `tools=[k]`, its `_generate_single_turn` (the
    model's sampling) replaced by the same forced turns: everything after sampling is TRL's."""
    rows = [turns[f"g0r{r}"] for r in range(TOOL_P * G)]
    heads: list[list[int]] = []

    def forced(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not heads:  # the first turn: every row, in order
            heads.extend(list(p) + t[0] for p, t in zip(prompt_ids, rows, strict=True))
            return [t[0] for t in rows], None
        out = []
        for ids in prompt_ids:  # prompt + first turn + TRL's tool suffix: the row whose head it starts with
            row = max(
                (r for r, h in enumerate(heads) if len(rows[r]) > 1 and list(ids[: len(h)]) == h),
                key=lambda r: len(heads[r]),
            )
            out.append(rows[row][1])
        return out, None

    trainer._generate_single_turn = forced
    trainer._metrics["train"].clear()
    return trainer._generate_and_score_completions(
        [{"prompt": [{"role": "user", "content": text}]} for text in prompts]
    )


def tool_case():
    """(gpufleet's parts, its episodes, TRL's trainer, TRL's batch) of the tool-calling case."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gpufleet.config.load import load_job
    from gpufleet.env.vault import k
    from gpufleet.rl.parts import build

    sets = [
        "env.name=builtin:vault", "env.format=chat", "env.servers=0", "env.max_turns=2",
        "env.max_action_tokens=96", "env.max_observation_tokens=64", f"env.max_episode_tokens={TOOL_LENGTH}",
        "rollout.tools=[gpufleet.env.vault:k]", "rollout.max_tool_calling_iterations=1",
        "rollout.max_prompt_length=64", "algorithm.num_generations=4", "algorithm.beta=0.04",
        "train.per_device_batch=12", "train.max_grad_norm=0", "output.dir=/tmp/trl_grad_equal_tools",
    ]  # fmt: skip
    parts = build(load_job(None, sets, env={}).job)
    parts.suppress_tokens = ()
    torch.manual_seed(2)
    with torch.no_grad():  # away from the init, as the loss cases
        [q.add_(0.02 * torch.randn_like(q)) for q in parts.policy.parameters()]
    e, turns = gpufleet_tool_episodes(parts)
    config = GRPOConfig(
        output_dir="/tmp/trl_grad_equal_tools_trl", per_device_train_batch_size=TOOL_P * G, num_generations=G,
        max_completion_length=TOOL_LENGTH, max_tool_calling_iterations=1, beta=0.04, use_cpu=True,
        report_to="none", bf16=False, fp16=False, activation_checkpointing=False, disable_tqdm=True,
    )  # fmt: skip
    rewards = [
        1.0,
        0.0,
        0.5,
        2.0,
        0.0,
        1.0,
        3.0,
        0.2,
        0.7,
        0.1,
        1.5,
        0.3,
    ]  # advantages of every sign; TRL's computes them
    trainer = GRPOTrainer(
        model=copy.deepcopy(parts.policy).train(),
        reward_funcs=[lambda prompts, completions, **kw: rewards],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "a:"}]}] * (TOOL_P * G)),
        processing_class=parts.tokenizer,
        tools=[k],  # TRL's own tool loop runs the calls
    )
    trainer.current_gradient_accumulation_steps = 1
    return parts, e, trainer, trl_tool_batch(trainer, e.prompts, turns)


def compare_tool_loop() -> None:
    """The tool-calling case: ids, loss mask and tool-result splice of each row (must be exact), TRL's tool
    metrics, then the step's gradient on that batch."""
    import torch

    from gpufleet.rl.batch import GenerationBatch
    from gpufleet.rl.episodes import episode_stats

    parts, e, trainer, out = tool_case()
    t_stats = {k: v[-1] for k, v in trainer._metrics["train"].items() if v and k.startswith("tools/")}
    g_stats = episode_stats(parts.rt, e)
    r = e.rollout
    t_loss_mask = out["completion_mask"] * out["tool_mask"]
    worst, spliced, compared = 0, 0, 0
    print(
        f"\n{'tool case row':<36} {'turns':>5} {'|ids|':>6} {'spliced':>8} {'dprompt':>8} {'dids':>5} {'dmask':>6}"
    )
    for i, (first, _) in enumerate(TOOL_TURNS):
        first = first.replace("{pad}", {0: "<fills>", 1: "<over 1>", -1: "<1 short>"}.get(FILL.get(i), ""))
        gp, tp = r.prompt_ids[i][r.prompt_mask[i].bool()], out["prompt_ids"][i][out["prompt_mask"][i].bool()]
        ga, ta = r.completion_mask[i].bool(), out["completion_mask"][i].bool()
        gi, ti = r.completion_ids[i][ga], out["completion_ids"][i][ta]
        gm, tm = e.loss_mask[i][ga], t_loss_mask[i][ta].float()
        pairs = ((gp, tp), (gi, ti), (gm, tm))  # a length that differs prints inf
        d = [(a - b).abs().max().item() if len(a) == len(b) else float("inf") for a, b in pairs]
        worst = max(worst, *d)
        spliced += int((tm == 0).sum())
        compared += len(ti)
        print(f"{first[:34]:<36} {int(e.counts['turns'][i]):>5} {len(ti):>6} {int((tm == 0).sum()):>8} "
              f"{d[0]:>8.0f} {d[1]:>5.0f} {d[2]:>6.0f}")  # fmt: skip
    print(
        f"ids, loss mask, splice: {compared} completion tokens ({spliced} spliced, mask 0), max |diff| {worst}"
    )
    for k in ("tools/call_frequency", "tools/failure_frequency"):
        print(f"{k}: TRL {t_stats.get(k)} gpufleet {g_stats.get(k)}")
    input_ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    attn = torch.cat([r.prompt_mask, r.completion_mask], 1)
    ref, start = out["ref_per_token_logps"], r.prompt_ids.shape[1]
    batch = GenerationBatch(input_ids, attn, e.loss_mask, out["advantages"], None, ref, start)
    print(f"{'tool case loss':<46} {'max|dgrad| mb8':>14} {'mb2':>9} {'|dloss|':>9}")
    for loss_type, level in [(t, "token") for t in ("grpo", "bnpo", "dr_grpo", "dapo")] + [
        ("grpo", "sequence")
    ]:
        t_loss, t_grads, _ = trl_side(trainer, trainer.model, out, loss_type, level, True, {})
        diffs = []
        for micro in (8, 2):
            g_loss, g_grads, _ = gpufleet_side(parts, batch, micro, loss_type, level, True, {}, TOOL_LENGTH)
            diffs.append(max((t_grads[k] - g_grads[k]).abs().max().item() for k in t_grads))
        label = f"{loss_type}/{level}"
        print(f"{label:<46} {diffs[0]:>14.2e} {diffs[1]:>9.2e} {abs(t_loss - g_loss):>9.2e}")


CHAT_TURNS = [  # single-turn completions on chat prompts, no tools: what parse_response makes of them
    "[k n=3]<eos>",  # a tool call's form (parsed into tool_calls, content "")
    "ab<pad>c<eos>",  # a special token inside: TRL decodes it
    "hel",  # cut at max_completion_length: no EOS
    "[]<eos>",  # brackets, no call
    "x [k n=3]<eos>",  # text, then a call's form
    "b<eos>",
    "A:q<eos>",  # the template's start anchor inside the turn
    "<eos>",  # an empty turn
]
CHAT_ROWS = [
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
        "answer": "5",
    },
    {"prompt": [{"role": "user", "content": "hi"}], "answer": "b"},
]


def compare_chat_rewards() -> None:
    """A single-turn batch on chat-format data (2 prompts x G=4, no tools): the `prompts` and `completions`
    TRL 1.16's reward function gets (its `_generate_and_score_completions`, `_generate_single_turn` forced)
    vs what gpufleet passes (`rewards.chat_said` on gpufleet's rendered prompts and the same ids)."""
    import json
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from gpufleet.config.schema import DataSection
    from gpufleet.engine.rollout import Rollout, left_pad
    from gpufleet.models.builtin import char_tokenizer, materialize
    from gpufleet.rl.batch import tokenize_prompts
    from gpufleet.rl.data import PromptSource
    from gpufleet.rl.rewards import chat_said

    tok = char_tokenizer()
    ids = [
        [i for n, part in enumerate(t.split("<pad>")) for i in [tok.pad_token_id][:n] + forced_ids(tok, part)]
        for t in CHAT_TURNS
    ]  # "<pad>": that token
    seen: dict = {}

    def reward(prompts, completions, **kw):
        seen.update(prompts=copy.deepcopy(prompts), completions=copy.deepcopy(completions))
        return [0.0] * len(prompts)

    config = GRPOConfig(
        output_dir="/tmp/trl_grad_equal_chat", per_device_train_batch_size=len(CHAT_TURNS), num_generations=G,
        max_completion_length=16, beta=0.0, use_cpu=True, report_to="none", disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(materialize("tiny-qwen2"))
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, processing_class=tok,
        train_dataset=Dataset.from_list([CHAT_ROWS[i // G] for i in range(len(CHAT_TURNS))]),
    )  # fmt: skip
    trainer._generate_single_turn = lambda prompt_ids, *a, **kw: ([list(r) for r in ids], None)
    out = trainer._generate_and_score_completions([CHAT_ROWS[i // G] for i in range(len(CHAT_TURNS))])
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
        source = PromptSource(DataSection(path=f"{d}/chat.jsonl", shuffle=False), 0)
        row_pos = [i // G for i in range(len(CHAT_TURNS))]
        heads, _ = tokenize_prompts(tok, [CHAT_ROWS[i]["prompt"] for i in row_pos], 64)
        prompt_ids, prompt_mask = left_pad(heads, tok.pad_token_id, torch.device("cpu"))
        width = max(map(len, ids))
        c_ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in ids])
        c_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
        rollout = Rollout(prompt_ids, prompt_mask, c_ids, c_mask, c_mask.sum(1), c_mask.sum(1) == width)
        said = chat_said(SimpleNamespace(source=source, tokenizer=tok), row_pos, rollout, [""] * 8, [""] * 8)
    t_heads = [r[m.bool()].tolist() for r, m in zip(out["prompt_ids"], out["prompt_mask"], strict=True)]
    print(
        f"\n{'chat-data rewards row':<24} {'prompt ids':>10} {'prompts':>8} {'completion':>10}  TRL's completion"
    )
    same = 0
    for i, text in enumerate(CHAT_TURNS):
        checks = (t_heads[i] == heads[i], seen["prompts"][i] == said["prompts"][i])
        checks += (seen["completions"][i] == said["completions"][i],)
        same += all(checks)
        marks = ["equal" if c else "DIFFER" for c in checks]
        print(f"{text:<24} {marks[0]:>10} {marks[1]:>8} {marks[2]:>10}  {seen['completions'][i]}")
    print(f"chat-data rewards: {same} of {len(CHAT_TURNS)} rows equal (prompt ids, prompts, completions)")
