"""Real models' chat templates as TRL 1.16 knows them, against gpufleet's models/known_templates.py.

    .bench-venv/bin/python bench/trl_templates_equal.py --write   # (re)write the package's data from TRL
    .bench-venv/bin/python bench/trl_templates_equal.py           # compare (run in the bench venv: trl)

`--write` fills src/gpufleet/models/chat_templates/: known.json (each original template TRL ships, by its
sha256, with its family's name, the response template `add_response_schema` attaches on this transformers
and the training template `get_training_chat_template` returns) and TRL's `*_training.jinja` (Apache-2.0).
The comparison, per family TRL attaches a response template to, on a locally built byte-level tokenizer
(tests/known_tok.py): gpufleet recognises it as TRL does, attaches the same response template, parses a
sampled tool-call turn to the message TRL's `parse_response` gives, and renders with TRL's training
template where TRL's GRPOTrainer would (its tools case: not prefix-preserving) or, where gpufleet renders
with the training template and TRL with the original (gpufleet's own prefix check, rl/chat.py, is stricter:
it keeps earlier turns' reasoning), that both give the same episode tokens (first prompt, tool and user
bridges). It prints what gpufleet's check then says of the episodes.

Measured (TRL 1.16.0, transformers 5.23.0, 2026-11-27): 26 families TRL attaches a response template to,
0 differ (response template, parsed tool-call message, rendering). gpufleet's check passes a tools job on 16
(Gemma 4 x5, GLM-4-MoE, LFM2, Llama-3.1/3.2, Qwen2.5, Qwen3 and Qwen3.5-think / Qwen3.6 with TRL's
training template, Qwen3.8, Qwen3-2507, Qwen3-VL) and refuses 10 with its reason: DeepSeek-R1-Distill (TRL:
no tool calling), gpt-oss, LFM2.5 x3, Nemotron 3 x4, Qwen3.5 no-think (they re-render earlier turns'
reasoning or the generation prompt's thinking opener; TRL's dummy-message check does not look there).
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "gpufleet" / "models" / "chat_templates"
NAMES = {  # TRL's file stem -> the family's name gpufleet prints
    "cohere": "Cohere", "cohere2": "Cohere2", "deepseek_r1_distill": "DeepSeek-R1-Distill",
    "deepseekv3": "DeepSeek-V3", "diffusion_gemma": "DiffusionGemma", "gemma": "Gemma", "gemma3": "Gemma 3",
    "gemma4": "Gemma 4", "gemma4_v2": "Gemma 4", "gemma4_v3": "Gemma 4", "gemma4_v4": "Gemma 4",
    "gemma4_v5": "Gemma 4", "glm4moe": "GLM-4-MoE", "gptoss": "gpt-oss", "idefics3": "Idefics3",
    "lfm2": "LFM2", "lfm2_v2": "LFM2", "lfm2_2_5": "LFM2.5", "lfm2_2_5_v2": "LFM2.5", "lfm2_2_5_vl": "LFM2.5-VL",
    "llama3": "Llama-3", "llama3_1": "Llama-3.1", "llama3_2": "Llama-3.2", "llava_next": "LLaVA-NeXT",
    "muse_glimmer": "Muse Glimmer", "nemotron_3_nano": "Nemotron 3 Nano", "nemotron_3_super": "Nemotron 3 Super",
    "nemotron_3_ultra": "Nemotron 3 Ultra", "nemotron_3_5_lightning": "Nemotron 3.5 Lightning", "phi3": "Phi-3",
    "phi3_5": "Phi-3.5", "qwen2_5": "Qwen2.5", "qwen2_5_vl": "Qwen2.5-VL", "qwen3": "Qwen3",
    "qwen3_instruct_2507": "Qwen3-2507", "qwen3_vl": "Qwen3-VL", "qwen3_5_nothink": "Qwen3.5",
    "qwen3_5_think": "Qwen3.5", "qwen3_6": "Qwen3.6", "qwen3_8": "Qwen3.8", "smolvlm": "SmolVLM",
}  # fmt: skip
NOTICE = (
    "The *_training.jinja chat templates here, and the response templates and template fingerprints in\n"
    "known.json, come from TRL {trl} (https://github.com/huggingface/trl, trl/chat_templates and\n"
    "trl/chat_template_utils.py), Copyright 2020-2026 The HuggingFace Team, licensed under the Apache\n"
    "License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0). Written by bench/trl_templates_equal.py.\n"
)


def write() -> None:
    import trl
    import trl.chat_template_utils as u

    folder = Path(u.__file__).parent / "chat_templates"
    named = {id(v): k.removesuffix("_template") for k, v in vars(u).items() if k.endswith("_template")}
    families, responses = [], {}
    for stem in sorted(NAMES):
        text = getattr(u, f"{stem}_chat_template")
        holder = types.SimpleNamespace(chat_template=text)
        try:
            u.add_response_schema(holder)
            response = named[id(holder.response_template)]
            responses[response] = holder.response_template
        except ValueError:
            response = None
        training = folder / f"{stem}_training.jinja"
        if training.is_file():
            (DATA / training.name).write_text(training.read_text(encoding="utf-8"), encoding="utf-8")
        families.append(
            {
                "key": stem,
                "name": NAMES[stem],
                "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                "response": response,
                "training": training.name if training.is_file() else None,
            }
        )
    known = {"trl": trl.__version__, "families": families, "response_templates": responses}
    (DATA / "known.json").write_text(json.dumps(known, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (DATA / "NOTICE").write_text(NOTICE.format(trl=trl.__version__), encoding="utf-8")
    print(f"wrote {len(families)} families, {len(responses)} response templates into {DATA}")


def sampled_turn(tok, template: str | None) -> tuple[list[int], list[int]]:
    """(context ids, a sampled tool-call turn's ids): the turn as the template renders it after the prompt
    (after the part of the prompt both share, where the template renders the turn without the prompt's
    thinking opener)."""
    user = [{"role": "user", "content": "What is 3 times 75001?"}]
    kw = {"tools": [TOOL], "chat_template": template, "tokenize": True, "return_dict": False}
    prompt = list(tok.apply_chat_template(user, add_generation_prompt=True, **kw))
    full = list(
        tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], **kw)
    )
    same = next((i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), len(prompt))
    turn = full[same:]  # a template may render the turn without the prompt's opener (<think>): the rest
    rest = prompt[same:]
    return prompt, turn[len(rest) :] if turn[: len(rest)] == rest else turn


def episode_tokens(tok, kwargs: dict) -> list[list[int]]:
    """What TRL's tool loop takes from the template, as gpufleet's chat episodes build it (rl/chat.py): the
    first prompt with the tools, the bridge after a tool call (its result)."""
    from gpufleet.rl.chat import ChatFormat

    fmt = ChatFormat(tok, [TOOL], kwargs)
    tool = [{"role": "tool", "name": "multiply", "content": "225003"}]
    return [fmt.first_prompt("What is 3 times 75001?"), fmt.bridge(tool)]


def compare_family(stem: str) -> list[str]:
    """What differs between TRL and gpufleet for this family (empty: equal); prints the family's line."""
    import trl.chat_template_utils as u

    from gpufleet.rl.chat import adopt_known, parse_response, template_problem

    text = getattr(u, f"{stem}_chat_template")
    ours, theirs = byte_tokenizer(text, eos_for(stem)), byte_tokenizer(text, eos_for(stem))
    u.add_response_schema(theirs)  # GRPOTrainer.__init__ with tools
    trl_template = (
        None if u.is_chat_template_prefix_preserving(theirs) else u.get_training_chat_template(theirs)
    )
    kwargs, note = adopt_known(ours, [TOOL], {})
    bad = []
    if ours.response_template != theirs.response_template:
        bad.append("response template")
    if kwargs.get("chat_template") != trl_template and episode_tokens(ours, kwargs) != episode_tokens(
        ours, {"chat_template": trl_template} if trl_template else {}
    ):
        bad.append(
            f"episode tokens (TRL renders with its {'training' if trl_template else 'original'} template)"
        )
    tools = u.supports_tool_calling(theirs)
    if tools:
        prefix, ids = sampled_turn(theirs, trl_template)
        want, got = (
            u.parse_response(theirs, ids, prefix=prefix, tools=[TOOL]),
            parse_response(ours, ids, prefix, [TOOL]),
        )
        if want != got:
            bad.append(f"parse_response: TRL {want} != gpufleet {got}")
        elif want.get("tool_calls") != [CALL]:
            bad.append(f"parse_response (both): {want.get('tool_calls')} is not the call {CALL}")
    why = template_problem(ours, [TOOL], kwargs)
    print(
        f"{stem:24} {'EQUAL' if not bad else 'DIFFERS'}  {note}; TRL's tool check: {tools}; "
        f"gpufleet check: {why or 'passes'}"[:400]
    )
    return bad


def compare() -> int:
    import transformers
    import trl
    import trl.chat_template_utils as u

    print(f"TRL {trl.__version__}, transformers {transformers.__version__}")
    failed = 0
    for stem in sorted(NAMES):
        try:
            u.add_response_schema(types.SimpleNamespace(chat_template=getattr(u, f"{stem}_chat_template")))
        except ValueError:
            continue  # TRL attaches nothing: gpufleet neither (a family TRL has no response template for)
        bad = compare_family(stem)
        for line in bad:
            print(f"    {line}")
        failed += bool(bad)
    print(f"{failed} families differ")
    return 1 if failed else 0


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    else:
        sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]
        from known_tok import CALL, TOOL, byte_tokenizer, eos_for

        sys.exit(compare())
