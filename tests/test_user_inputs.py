"""Issue 12.1: a user's bad data file, model folder or reward module is one clean error, never a traceback.

Each case writes a real bad file into a user's folder and runs the installed `gpufleet` from there:
`check` must exit 2 and name the field, the file and the line/row; a few run through `train` too. A
tokenizer that loses text is a warning and training goes on.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gpufleet import datafile
from helpers import run_user, sets

JOB = """\
model: {path: "builtin:tiny-qwen2"}
data: {path: prompts.jsonl}
reward: {functions: ["my_rewards:length"]}
rollout: {max_prompt_length: 16, max_completion_length: 8}
train: {per_device_batch: 4, max_steps: 1}
algorithm: {num_generations: 2}
output: {dir: run}
"""

REWARDS = """\
def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]
"""

GOOD_ROWS = b'{"prompt": "ab", "answer": "1"}\n{"prompt": "cd", "answer": "2"}\n'


@pytest.fixture()
def home(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_bytes(GOOD_ROWS)
    return tmp_path


def check(home, *values: str):
    p = run_user("check", "job.yaml", "--gpus", "cpu", *sets(*values), cwd=home, timeout=120)
    return p.returncode, p.stdout + p.stderr


def assert_clean_error(code: int, out: str, *must: str) -> None:
    assert code == 2, out
    assert "Traceback" not in out, out
    for text in must:
        assert text in out, f"{text!r} not in:\n{out}"


def _big_line() -> bytes:
    return b'{"prompt": "' + b"a" * (datafile.MAX_LINE_BYTES + 10) + b'"}\n'


def _parquet(rows) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist(rows) if rows else pa.table({"prompt": pa.array([], pa.string())}), buf
    )
    return buf.getvalue()


# (id, file name, bytes, field named, texts that must appear: file, line/row, what is wrong)
DATA = [
    (
        "jsonl-malformed",
        "d.jsonl",
        b'{"prompt": "a"}\n{not json\n',
        "data.path",
        ["d.jsonl line 2", "not valid JSON"],
    ),
    (
        "jsonl-not-object",
        "d.jsonl",
        b'{"prompt": "a"}\n[1, 2]\n',
        "data.path",
        ["d.jsonl line 2", "an object"],
    ),
    ("json-array-broken", "d.json", b'[{"prompt": "a"},\n {"prompt": }]', "data.path", ["d.json", "line 2"]),
    (
        "csv-unterminated-quote",
        "d.csv",
        b'prompt,answer\nab,1\n"cd,2\nef,3\n',
        "data.path",
        ["d.csv line 3", "quote"],
    ),
    (
        "csv-column-count",
        "d.csv",
        b"prompt,answer\nab,1\ncd,2,3\n",
        "data.path",
        ["d.csv line 3", "3 fields"],
    ),
    ("csv-header-only", "d.csv", b"prompt,answer\n", "data.path", ["d.csv holds no rows"]),
    (
        "csv-semicolons",
        "d.csv",
        b"prompt;answer\na:;x\n",
        "data.path",
        ["d.csv is not comma-separated", "'prompt;answer'", "df.to_csv"],
    ),
    ("parquet-corrupt", "d.parquet", b"PAR1 this is not parquet PAR1", "data.path", ["d.parquet", "parquet"]),
    ("parquet-no-rows", "d.parquet", None, "data.path", ["d.parquet holds no rows"]),
    ("parquet-null-prompt", "d.parquet", "nulls", "data.prompt_field", ["d.parquet row 2", "null"]),
    ("empty", "d.jsonl", b"", "data.path", ["d.jsonl is empty"]),
    ("blank-lines-only", "d.jsonl", b"\n  \n\n", "data.path", ["d.jsonl is empty"]),
    (
        "latin-1",
        "d.jsonl",
        b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
        "data.path",
        ["line 2 is not UTF-8", "iconv"],
    ),
    (
        "utf-16-bom",
        "d.jsonl",
        '{"prompt": "a"}\n'.encode("utf-16"),
        "data.path",
        ["UTF-16", "iconv -f utf-16"],
    ),
    ("huge-line", "d.jsonl", b'{"prompt": "a"}\n' + _big_line(), "data.path", ["d.jsonl line 2", "1 MiB"]),
    (
        "prompt-missing-in-row",
        "d.jsonl",
        b'{"prompt": "a"}\n{"prompt": "b"}\n{"question": "c"}\n',
        "data.prompt_field",
        ["line 3 has no 'prompt'"],
    ),
    (
        "prompt-missing-in-first-row",
        "d.jsonl",
        b'{"question": "c"}\n{"prompt": "a"}\n',
        "data.prompt_field",
        ["line 1 has no 'prompt'"],
    ),
    (
        "prompt-empty-csv-cell",
        "d.csv",
        b"question,prompt\nq,\n",
        "data.prompt_field",
        ["line 2", "an empty string"],
    ),
    (
        "prompt-number",
        "d.jsonl",
        b'{"prompt": "a"}\n{"prompt": 42}\n',
        "data.prompt_field",
        ["line 2", "a number (42)"],
    ),
    ("prompt-list", "d.jsonl", b'{"prompt": ["a", "b"]}\n', "data.prompt_field", ["line 1", "chat messages"]),
    (
        "prompt-null",
        "d.json",
        b'[{"prompt": "a"}, {"prompt": null}]',
        "data.prompt_field",
        ["d.json record 2", "null"],
    ),
    (
        "no-prompt-column",
        "d.jsonl",
        b'{"question": "a"}\n',
        "data.prompt_field",
        ["no column 'prompt'", "data.prompt_field=question"],
    ),
    ("folder", "d.jsonl", "folder", "data.path", ["d.jsonl is a folder"]),
]


@pytest.mark.parametrize("case", DATA, ids=[c[0] for c in DATA])
def test_bad_data_file(home, case):
    _, name, content, field, must = case
    path = home / name
    if content == "folder":
        path.mkdir()
    elif name.endswith(".parquet") and not isinstance(content, bytes):
        path.write_bytes(_parquet([{"prompt": "a"}, {"prompt": None}] if content == "nulls" else []))
    else:
        path.write_bytes(content)
    code, out = check(home, f"data.path={name}")
    assert_clean_error(code, out, f"error: {field}", *must)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_data_file(home):
    (home / "prompts.jsonl").chmod(0)
    assert_clean_error(*check(home), "data.path", "prompts.jsonl cannot be read")


def test_good_files_pass(home):
    (home / "d.csv").write_bytes(b'prompt,answer\n"a, b",1\n"say ""hi""",2\n')
    (home / "d.parquet").write_bytes(_parquet([{"prompt": "a", "answer": 1}]))
    (home / "d.json").write_bytes(
        b'[{"prompt": "hi", "answer": "1"}]'
    )  # chat rows: test_chat_prompts_need_a_chat_template
    (home / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + GOOD_ROWS)
    for name in ("prompts.jsonl", "d.csv", "d.parquet", "d.json", "bom.jsonl"):
        code, out = check(home, f"data.path={name}")
        assert code == 0 and "error" not in out, out


def test_check_parses_a_bounded_head_and_load_the_rest_the_same_way(tmp_path):
    """Beyond FULL_CHECK_BYTES check reads CHECK_HEAD_ROWS rows; the loader finds the same error later."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n' * 3 + b'{"prompt": 7}\n')
    head = datafile.scan(path, "prompt", max_rows=3)
    assert head.count == 3 and not head.complete
    with pytest.raises(datafile.DataFileError, match="line 4"):
        datafile.scan(path, "prompt", keep=True)
    path.write_bytes(GOOD_ROWS)
    rows = datafile.scan(path, "prompt", keep=True)
    assert len(rows) == 2 and rows[1] == {"prompt": "cd", "answer": "2"}


# ---------------------------------------------------------------------------------- model folders


@pytest.fixture(scope="module")
def tiny_model():
    from gpufleet.models.builtin import materialize

    return materialize("tiny-qwen2")


def _edit_json(name: str, change):
    def edit(folder):
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))

    return edit


MODELS = [
    ("no-config", lambda f: (f / "config.json").unlink(), "no config.json"),
    (
        "broken-config",
        lambda f: (f / "config.json").write_text('{"model_type": "qwen2",\n'),
        "config.json is not valid JSON",
    ),
    ("config-no-model-type", _edit_json("config.json", lambda d: d.pop("model_type")), "has no model_type"),
    ("no-weights", lambda f: (f / "model.safetensors").unlink(), "holds no weights"),
    (
        "no-tokenizer",
        lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        "holds no tokenizer",
    ),
    (
        "broken-tokenizer-json",
        lambda f: (f / "tokenizer.json").write_text('{"model":\n'),
        "tokenizer.json is not valid JSON (Expecting value at line 2",
    ),
    (
        "tokenizer-json-unloadable",
        lambda f: (f / "tokenizer.json").write_text('{"model": {"type": "Nope"}}'),
        "tokenizer.json cannot be loaded",
    ),
    ("no-eos", _edit_json("tokenizer_config.json", lambda d: d.pop("eos_token")), "has no eos token"),
]


@pytest.mark.parametrize("case", MODELS, ids=[c[0] for c in MODELS])
def test_bad_model_folder(home, tiny_model, case):
    _, mutate, text = case
    shutil.copytree(tiny_model, home / "model")
    mutate(home / "model")
    assert_clean_error(*check(home, "model.path=model"), "error: model.path", text)


# ------------------------------------------------------------------------------------ reward modules

REWARD_MODULES = [
    ("module-missing", None, "nosuch:f", "no module 'nosuch'"),
    ("import-raises", "import json\n\nTABLE = {}\nVALUE = TABLE['k']\n", "bad:f", "raised KeyError: 'k' at"),
    ("syntax-error", "def f(:\n    pass\n", "bad:f", "bad.py:1: SyntaxError"),
    (
        "missing-dependency",
        "import nonexistent_package_zz\n",
        "bad:f",
        "No module named 'nonexistent_package_zz'",
    ),
    (
        "name-missing",
        "def g(prompts, completions, **kw):\n    return []\n",
        "bad:f",
        "defines no 'f' (it has g)",
    ),
    ("not-callable", "f = 3\n", "bad:f", "is not a function"),
    (
        "wrong-signature",
        "def f(prompts):\n    return []\n",
        "bad:f",
        "f(prompts) has no parameter for 'completions', 'completion_ids', 'answer', which gpufleet passes "
        "by keyword",
    ),
    (
        "no-kwargs-for-columns",
        "def f(prompts, completions):\n    return []\n",
        "bad:f",
        "has no parameter for 'completion_ids', 'answer'",
    ),
]


@pytest.mark.parametrize("case", REWARD_MODULES, ids=[c[0] for c in REWARD_MODULES])
def test_bad_reward_module(home, case):
    _, source, ref, text = case
    if source is not None:
        (home / "bad.py").write_text(source)
    code, out = check(home, f"reward.functions={ref}")
    assert_clean_error(code, out, "error: reward.functions", text)
    if case[0] == "import-raises":
        assert "bad.py:4" in out


# ------------------------------------------------------------------------------------------ train


@pytest.mark.parametrize(
    "values, text",
    [
        (["data.path=d.jsonl"], "d.jsonl line 2 is not valid JSON"),
        (["reward.functions=bad:f"], "raised ZeroDivisionError: division by zero at"),
        (["data.path=d.csv"], "d.csv line 2"),
    ],
    ids=["malformed-jsonl", "reward-import-raises", "csv-unterminated-quote"],
)
def test_train_refuses_cleanly(home, values, text):
    (home / "d.jsonl").write_bytes(b'{"prompt": "a"}\n{not json\n')
    (home / "d.csv").write_bytes(b'prompt\n"never closed\n')
    (home / "bad.py").write_text("RATIO = 1 / 0\n")
    p = run_user(
        "train", "job.yaml", "--gpus", "cpu", *sets("train.max_steps=1", *values), cwd=home, timeout=300
    )
    assert_clean_error(p.returncode, p.stdout + p.stderr, text, "Nothing was started")


@pytest.mark.slow  # end to end (~10 s); make test-slow runs it
def test_lossy_tokenizer_warns_and_training_goes_on(home, tiny_model):
    """A tokenizer that lowercases: check warns with an example, train warns once and finishes."""
    shutil.copytree(tiny_model, home / "model")
    _edit_json("tokenizer.json", lambda d: d.update(normalizer={"type": "Lowercase"}))(home / "model")
    code, out = check(home, "model.path=model")
    assert code == 0, out
    assert "warning: model.path" in out and "'A b' decodes as 'a b'" in out and "decoded text" in out
    p = run_user(
        "train", "job.yaml", "--gpus", "cpu", *sets("model.path=model", "train.max_steps=1"), cwd=home
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert out.count("decodes as") == 1 and "Traceback" not in out
    assert (home / "run" / "final" / "config.json").is_file()


def test_no_warning_for_save_every_beyond_max_steps(home):
    code, out = check(home, "output.save_every=50", "train.max_steps=1")
    assert code == 0 and "save_every" not in out, out


def test_chat_prompts_need_a_chat_template(home, tiny_model):
    """Issue 17 item 3: chat-format data with a tokenizer that has no chat template is check's error;
    the built-in models' tokenizers have one (models/chat.py)."""
    (home / "chat.jsonl").write_text('{"prompt": [{"role": "user", "content": "ab"}], "answer": "1"}\n' * 2)
    code, out = check(home, "data.path=chat.jsonl")
    assert "chat template" not in out, out
    shutil.copytree(tiny_model, home / "model")
    (home / "model" / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((home / "model" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (home / "model" / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, out = check(home, "data.path=chat.jsonl", "model.path=model")
    assert_clean_error(code, out, "error: data.path", "has no chat template", "chat.jsonl line 1")
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (home / "model" / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, out = check(home, "data.path=chat.jsonl", "model.path=model")
    assert "chat template" not in out, out
