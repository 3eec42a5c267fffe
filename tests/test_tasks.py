"""Built-in tasks: deterministic examples, hand-checked rewards, the registry, and a torch-free import."""

import subprocess
import sys

import pytest

from gpufleet.tasks import CHARS, TASKS, builtin_reward, get_task, reward_names
from gpufleet.tasks.add import extract_answer
from gpufleet.tasks.base import char_match

GARBAGE = ["", "x" * 10_000, "\n\n\n", "<answer></answer>", "<answer>12", "ü€\x00", "<eos><pad>"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_make_example_is_deterministic_and_uses_the_charset(name):
    task = get_task(name)
    first = task.examples(50, seed=3)
    assert first == task.examples(50, seed=3)
    assert task.make_example(17, 3) == first[17]
    assert task.examples(50, seed=4) != first
    for example in first:
        assert set(example["prompt"]) <= set(CHARS)
        assert set(example["target"]) <= set(CHARS)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_default_rewards_score_the_target_one(name):
    task = get_task(name)
    examples = task.examples(20, seed=0)
    prompts = [e["prompt"] for e in examples]
    targets = [e["target"] for e in examples]
    for reward in task.default_rewards:
        assert builtin_reward(reward)(prompts, targets, target=targets) == [1.0] * 20


@pytest.mark.parametrize("reward", reward_names())
def test_rewards_never_raise_on_odd_completions_and_stay_in_0_1(reward):
    fn = builtin_reward(reward)
    completions = [*GARBAGE, None, 42, [{"role": "assistant", "content": "kk"}]]
    n = len(completions)
    scores = fn(["k:"] * n, completions, target=["kkkkkkkk"] * n, unknown_column=[object()] * n)
    assert len(scores) == n
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores)


def test_repeat_examples_and_chars_reward_by_hand():
    example = get_task("repeat").make_example(0, 0)
    letter = example["prompt"][0]
    assert example == {"prompt": f"{letter}:", "target": letter * 8}

    chars = builtin_reward("repeat/chars")
    completions = ["kkkkkkkk", "", "kkkk", "kkkkkkkkkk", "kxkxkxkx", "xkkkkkkk", "zzzzzzzz", "k" * 16]
    scores = chars(["k:"] * 8, completions, target=["kkkkkkkk"] * 8)
    assert scores == pytest.approx([1.0, 0.0, 0.5, 0.8, 0.5, 7 / 8, 0.0, 0.5])


def test_repeat_stops_reward_by_hand():
    stops = builtin_reward("repeat/stops")
    # 1 at length 8 whatever the characters; 1/8 less per missing character, 2/8 less per extra one.
    completions = [
        "kkkkkkkk",
        "zzzzzzzz",
        "kkkkkkk",
        "kkkk",
        "",
        "kkkkkkkkk",
        "kkkkkkkkkk",
        "k" * 12,
        "k" * 20,
    ]
    scores = stops(["k:"] * 9, completions, target=["kkkkkkkk"] * 9)
    assert scores == pytest.approx([1.0, 1.0, 7 / 8, 0.5, 0.0, 6 / 8, 0.5, 0.0, 0.0])
    assert stops(["k:"], [None], target=["kkkkkkkk"]) == [0.0]
    assert stops(["k:"] * 2, ["", "x"], target=["", ""]) == [1.0, 0.0]


def test_repeat_letters_stopped_echo_by_hand():
    completions = ["kkkkkkkk", "kkkkkkkkk", "kkkkkkkkx", "kxkxkxkx", "kkkk", "", "zzzzzzzzk", "k" * 12]
    n, target = len(completions), ["kkkkkkkk"] * len(completions)
    letters = builtin_reward("repeat/letters")(["k:"] * n, completions, target=target)
    assert letters == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 1.0])
    stopped = builtin_reward("repeat/stopped")(["k:"] * n, completions, target=target)
    assert stopped == [1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # x the letters
    echo = builtin_reward("repeat/echo")(["k:"] * n, completions, target=target)
    assert echo == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # x the letters
    assert builtin_reward("repeat/echo")(["k:"], ["k"], target=[""]) == [0.0]


def test_repeat_exact_reward():
    exact = builtin_reward("repeat/exact")
    assert exact(["a:"] * 3, ["aaaaaaaa", "aaaaaaa", "aaaaaaaaa"], target=["aaaaaaaa"] * 3) == [1.0, 0.0, 0.0]


def test_add_examples_and_rewards_by_hand():
    task = get_task("add")
    for example in task.examples(100, seed=1):
        a, b = example["prompt"].rstrip("=").split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert example["target"] == str(int(a) + int(b))

    completions = [
        "85",
        " 85\n",
        "<answer>85</answer>",
        "think 9 <answer>84</answer>",
        "8",
        "853",
        "58",
        "",
        "x",
    ]
    n = len(completions)
    prompts, targets = ["47+38="] * n, ["85"] * n
    digits = builtin_reward("add/digits")(prompts, completions, target=targets)
    assert digits == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 2 / 3, 0.0, 0.0, 0.0])
    exact = builtin_reward("add/exact")(prompts, completions, target=targets)
    assert exact == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    fmt = builtin_reward("add/format")(prompts, completions)
    assert fmt == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_extract_answer_takes_the_last_tagged_answer():
    assert extract_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert extract_answer("<answer>12") == "<answer>12"


def test_char_match_edges():
    assert char_match("", "") == 1.0
    assert char_match("", "ab") == 0.0
    assert char_match("abc", "ab") == pytest.approx(2 / 3)


def test_missing_target_column_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the dataset column 'target'"):
        builtin_reward("repeat/chars")(["a:"], ["aaaaaaaa"])
    with pytest.raises(ValueError, match="2 values of 'target' for 1 completions"):
        builtin_reward("add/digits")(["1+1="], ["2"], target=["2", "3"])


def test_registry_names_and_errors():
    assert {"repeat", "add"} <= set(TASKS)
    assert "repeat/chars" in reward_names() and "add/digits" in reward_names()
    for task in TASKS.values():
        for reward in task.default_rewards:
            assert reward in reward_names()
        assert {"num_generations", "per_device_batch", "max_completion_length", "learning_rate"} <= set(
            task.suggested
        )
        assert task.suggested["per_device_batch"] % task.suggested["num_generations"] == 0
    with pytest.raises(ValueError, match="unknown task 'nope'; known tasks: add, repeat"):
        get_task("nope")
    for bad in ["chars", "repeat/nope", "nope/chars", "", "repeat/"]:
        with pytest.raises(ValueError, match="names are '<task>/<fn>', known: add/digits"):
            builtin_reward(bad)


def test_importing_tasks_does_not_import_torch():
    code = (
        "import gpufleet.tasks, sys; "
        "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
