"""Issue 34 section 2: `check` and `plan` agree on the reward model: what is counted, what is not (said
on plan's fits line), and what cannot be a reward model (read from config.json's `architectures` and
labels, before train loads anything).

Through the installed `gpufleet` from a user's folder, offline (HF_HUB_OFFLINE=1, an empty Hugging Face
cache of the test's own): an uncached hub id gpufleet does not know is not "known" to check and not
counted by plan; its config.json alone in the cache (`hf download ID config.json`) lets plan count it and
check pass with a warning, so both can be satisfied offline; a causal LM is refused by check and train
at once and noted by plan.
"""

from __future__ import annotations

import json
import shutil

import pytest

from gpufleet.models.known import known_config
from helpers import run_user, sets

JOB = """\
model: {path: "builtin:tiny-qwen2"}
data: {path: "builtin:repeat"}
reward: {model: nobody/does-not-exist-rm}
rollout: {max_prompt_length: 16, max_completion_length: 8}
train: {per_device_batch: 2, max_steps: 1}
algorithm: {num_generations: 2}
output: {dir: run}
"""
RM = "nobody/does-not-exist-rm"


@pytest.fixture()
def home(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    return tmp_path


def offline(home) -> dict[str, str]:
    """An empty Hugging Face cache of the test's own, and no network."""
    return {
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HOME": str(home / "hf"),
        "XDG_CACHE_HOME": str(home / "xdg"),
        "HF_HUB_OFFLINE": "1",
    }


def gpufleet(home, *args: str, env=None):
    p = run_user(*args, cwd=home, env_extra={**offline(home), **(env or {})}, timeout=120)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    return p.returncode, out


def fits_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(("fits", "does not fit")))


def classifier_8b() -> dict:
    """Llama-3.1-8B's shape with a one-label score head: an 8B reward model's config.json."""
    raw = known_config("meta-llama/Llama-3.1-8B-Instruct")
    raw.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"})
    return raw


def cache_config_only(home, hub_id: str, raw: dict) -> None:
    """What `hf download ID config.json` leaves in the cache: a snapshot with config.json alone."""
    snap = home / "hub" / f"models--{hub_id.replace('/', '--')}" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(raw))


def test_an_uncached_unknown_reward_model_is_not_counted_and_both_say_so(home):
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "1x24GB")
    assert code == 0, out
    assert "known to gpufleet" not in out.replace("not known to gpufleet", ""), out
    assert "its shape is not known to gpufleet: its memory is not counted" in out, out
    assert f"hf download {RM} config.json" in out, out
    code, out = gpufleet(home, "plan", "job.yaml", "--gpus", "1x24GB")
    assert code == 0, out
    line = fits_line(out)
    assert line.startswith("fits:") and f"The reward model {RM} is not counted" in line, line
    assert f"hf download {RM} config.json" in line, line


def test_its_config_json_alone_makes_plan_count_it_and_check_agree(home):
    """The fits line was wrong by a whole 8B reward model: with its config.json in the cache, plan counts
    it (it does not fit 24 GB) and check, offline, says the same and only warns about the weights."""
    cache_config_only(home, RM, classifier_8b())
    code, out = gpufleet(home, "plan", "job.yaml", "--gpus", "1x24GB")
    assert code == 2 and fits_line(out).startswith("does not fit"), out
    assert "not counted" not in out, out
    code, json_out = gpufleet(home, "plan", "job.yaml", "--gpus", "1x80GB", "--format", "json")
    devices = json.loads(json_out)["plan"]["devices"]
    weights = devices[0]["components_bytes"]["weights"]
    assert code == 0 and weights > 7.4e9 * 4, weights  # fp32 weights of 7.5B parameters
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "1x24GB")
    assert code == 2 and "(policy rank 0 + reward model) needs" in out, out
    assert f"the reward model {RM} 7.50B." in out, out  # 8.03B less the LM head: a score head
    assert f"only the config.json of {RM} is in the local Hugging Face cache" in out, out
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "1x80GB")
    assert code == 0 and "reward.model" in out and "1 warning" in out, out


@pytest.fixture(scope="module")
def tiny_folder():
    from gpufleet.models.builtin import materialize

    return materialize("tiny-qwen2")


def model_folder(home, tiny_folder, name: str, **config) -> str:
    """A copy of the tiny built-in model folder (weights, tokenizer) with config.json changed."""
    folder = home / name
    shutil.copytree(tiny_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(config)
    (folder / "config.json").write_text(json.dumps(raw))
    return name


@pytest.mark.parametrize(
    "config, must",
    [
        ({}, "is Qwen2ForCausalLM, a causal language model: it has no classification head"),
        (
            {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "bad", "1": "good"}},
            "has 2 labels; a reward model gives one score per text",
        ),
        (
            {"architectures": ["Qwen2ForSequenceClassification"]},
            "has 2 labels (its config.json names none: transformers' default)",
        ),
    ],
    ids=["causal-lm", "two-labels", "labels-unsaid"],
)
def test_what_cannot_be_a_reward_model_is_refused_by_check_and_train_and_noted_by_plan(
    home, tiny_folder, config, must
):
    rm = model_folder(home, tiny_folder, "rm", **config)
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"reward.model={rm}"))
    assert code == 2 and "error: reward.model" in out and must in out, out
    assert "a reward model with" in out and "reward.functions" in out, out  # the fix
    code, out = gpufleet(home, "train", "job.yaml", "--gpus", "cpu", *sets(f"reward.model={rm}"))
    assert code == 2 and must in out and "Nothing was started" in out, out
    assert not (home / "run").exists()
    code, out = gpufleet(home, "plan", "job.yaml", "--gpus", "1x24GB", *sets(f"reward.model={rm}"))
    assert code == 0 and must in out and "cannot be a reward model" in fits_line(out), out


def test_a_one_label_classifier_passes(home, tiny_folder):
    rm = model_folder(
        home, tiny_folder, "rm", architectures=["Qwen2ForSequenceClassification"], id2label={"0": "LABEL_0"}
    )
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"reward.model={rm}"))
    assert code == 0 and "reward.model" not in out, out
    code, out = gpufleet(home, "plan", "job.yaml", "--gpus", "1x24GB", *sets(f"reward.model={rm}"))
    assert code == 0 and "reward model" in out and "not counted" not in out, out


def test_builtin_and_known_causal_lms_are_refused(home):
    for rm in ("builtin:tiny-qwen2", "Qwen/Qwen2.5-0.5B-Instruct"):
        code, out = gpufleet(home, "check", "job.yaml", "--gpus", "cpu", *sets(f"reward.model={rm}"))
        assert code == 2 and "a causal language model" in out, out
        assert "downloads its weights" not in out, out  # no "download it" for what cannot be one


def test_a_folder_with_config_json_alone(home):
    """Counted by plan, with a note that check refuses it; refused by check, which says why."""
    (home / "rm").mkdir()
    (home / "rm" / "config.json").write_text(json.dumps(classifier_8b()))
    code, out = gpufleet(home, "plan", "job.yaml", "--gpus", "1x80GB", *sets("reward.model=rm"))
    assert code == 0 and "holds no weights: counted from its config.json" in out, out
    code, out = gpufleet(home, "check", "job.yaml", "--gpus", "1x80GB", *sets("reward.model=rm"))
    assert code == 2 and "holds no weights" in out and "hf download ID config.json" in out, out


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("Skywork/Skywork-Reward-V2", "fix: --set reward.model=Skywork/Skywork-Reward-V2 (and remove it"),
        ("repeat/leters", "fix: did you mean 'repeat/letters'?"),
    ],
)
def test_a_reward_model_named_as_a_function_points_at_reward_model(home, name, fix):
    """TRL's reward_funcs takes a model id beside functions; gpufleet's reward.functions does not: the fix
    moves it to reward.model. A misspelt built-in reward (task/name, shaped like a hub id) still gets its
    did-you-mean."""
    job = home / "job.yaml"
    job.write_text(
        job.read_text().replace(
            "reward: {model: nobody/does-not-exist-rm}", f"reward: {{functions: [{name}]}}"
        )
    )
    p = run_user("check", "job.yaml", "--gpus", "cpu", cwd=home, env_extra=offline(home))
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert fix in p.stdout, p.stdout
