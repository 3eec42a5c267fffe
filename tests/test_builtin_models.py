"""Built-in tiny models: cheap import, exact configs, idempotent race-safe materialize, and loading."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest

from gpufleet.models import builtin as bm
from gpufleet.models import load_causal_lm, load_tokenizer, resolve_model_path
from gpufleet.models.builtin import (
    BUILTIN_MODELS,
    CHAR_VOCAB,
    EOS_TOKEN,
    PAD_TOKEN,
    builtin_config,
    builtin_name,
    is_builtin,
    materialize,
)

TEXT = " Hi there!\n  12+30=42?\n(a*b)/[c-d] <x>#'\"q;:.,\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def qwen_dir(root):
    return materialize("tiny-qwen2", root=root)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_import_needs_neither_torch_nor_transformers():
    code = "import sys, gpufleet.models.builtin; assert not {'torch', 'transformers'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_char_vocab():
    assert CHAR_VOCAB[0] == PAD_TOKEN and CHAR_VOCAB[1] == EOS_TOKEN
    assert len(CHAR_VOCAB) == len(set(CHAR_VOCAB)) == 2 + 10 + 26 + 26 + 22
    assert all(len(tok) == 1 for tok in CHAR_VOCAB[2:])
    assert set(TEXT) <= set(CHAR_VOCAB)


def test_configs():
    assert {"tiny-qwen2", "tiny-llama", "small-qwen2"} <= set(BUILTIN_MODELS)
    qwen = BUILTIN_MODELS["tiny-qwen2"]
    assert qwen["model_type"] == "qwen2" and qwen["tie_word_embeddings"] is True
    assert (qwen["hidden_size"], qwen["num_hidden_layers"], qwen["num_attention_heads"]) == (64, 2, 4)
    assert (qwen["num_key_value_heads"], qwen["intermediate_size"], qwen["max_position_embeddings"]) == (
        2,
        128,
        1024,
    )
    llama = BUILTIN_MODELS["tiny-llama"]
    assert llama["model_type"] == "llama" and llama["tie_word_embeddings"] is False
    small = BUILTIN_MODELS["small-qwen2"]
    assert (small["hidden_size"], small["num_hidden_layers"], small["intermediate_size"]) == (128, 4, 256)
    for config in BUILTIN_MODELS.values():
        assert config["vocab_size"] == len(CHAR_VOCAB)
        assert (config["pad_token_id"], config["eos_token_id"]) == (0, 1)
        assert config["hidden_size"] % config["num_attention_heads"] == 0
        json.dumps(config)  # exactly what config.json holds


def test_names():
    assert is_builtin("builtin:tiny-qwen2") and not is_builtin("Qwen/Qwen2.5-0.5B")
    assert builtin_name("builtin:tiny-llama") == "tiny-llama"
    assert builtin_config("builtin:tiny-qwen2") == BUILTIN_MODELS["tiny-qwen2"]
    builtin_config("tiny-qwen2")["hidden_size"] = 1  # a copy: the table is not modified
    assert BUILTIN_MODELS["tiny-qwen2"]["hidden_size"] == 64
    with pytest.raises(ValueError, match=r"unknown built-in model 'nope'.*builtin:tiny-qwen2"):
        builtin_config("builtin:nope")


def test_materialize_writes_a_hf_folder_once(root, qwen_dir):
    assert qwen_dir == root / "models" / "tiny-qwen2"
    names = {p.name for p in qwen_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((qwen_dir / "config.json").read_text()) == BUILTIN_MODELS["tiny-qwen2"]
    stamp = (qwen_dir / "model.safetensors").stat().st_mtime_ns
    assert materialize("builtin:tiny-qwen2", root=root) == qwen_dir
    assert (qwen_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in qwen_dir.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_materialize_is_seeded_and_bitwise_reproducible(tmp_path, qwen_dir):
    again = materialize("tiny-qwen2", root=tmp_path)
    assert sha256(again / "model.safetensors") == sha256(qwen_dir / "model.safetensors")
    other = materialize("tiny-qwen2", root=tmp_path, seed=1)
    assert other.name == "tiny-qwen2-seed1"
    assert sha256(other / "model.safetensors") != sha256(qwen_dir / "model.safetensors")


def test_default_root_is_gpufleet_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path))
    assert bm.default_root() == tmp_path
    assert bm.model_dir("builtin:tiny-llama") == tmp_path / "models" / "tiny-llama"
    path = resolve_model_path("builtin:tiny-qwen2")
    assert path == str(tmp_path / "models" / "tiny-qwen2")
    assert resolve_model_path("/some/folder") == "/some/folder"


def test_losing_the_race_keeps_the_winners_folder(tmp_path, monkeypatch):
    real_build = bm._build

    def build_while_another_process_wins(folder, config, seed):
        monkeypatch.setattr(bm, "_build", real_build)
        materialize("tiny-llama", root=tmp_path)  # the "other process" finishes first
        real_build(folder, config, seed)

    monkeypatch.setattr(bm, "_build", build_while_another_process_wins)
    target = materialize("tiny-llama", root=tmp_path)
    assert json.loads((target / "config.json").read_text()) == BUILTIN_MODELS["tiny-llama"]
    assert [p.name for p in target.parent.iterdir()] == ["tiny-llama"]  # loser's temp folder removed


def test_two_processes_at_once(tmp_path):
    """Real concurrency on the rename protocol; the build is faked (and slowed) to keep it fast."""
    code = textwrap.dedent(
        f"""
        import json, time
        from gpufleet.models import builtin as bm

        def fake_build(folder, config, seed):
            (folder / "config.json").write_text(json.dumps(config))
            time.sleep(0.3)  # both processes are now building
            (folder / "model.safetensors").write_text("weights")
            (folder / "tokenizer.json").write_text('{{"model": {{"unk_token": "?"}}}}')
            (folder / "tokenizer_config.json").write_text(json.dumps({{"response_template": bm.RESPONSE_TEMPLATE}}))
            (folder / "chat_template.jinja").write_text(bm.CHAT_TEMPLATE)

        bm._build = fake_build
        print(bm.materialize("tiny-qwen2", root={str(tmp_path)!r}))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert set(outs) == {str(tmp_path / "models" / "tiny-qwen2")}
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-qwen2"]


def test_a_folder_whose_tokenizer_has_no_unknown_fallback_is_rebuilt(tmp_path):
    """Issue 18: a cache from before the "?" fallback is rebuilt (the weights come out the same)."""
    folder = materialize("tiny-qwen2", root=tmp_path)
    weights = (folder / "model.safetensors").read_bytes()
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["unk_token"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    assert materialize("tiny-qwen2", root=tmp_path) == folder
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["unk_token"] == "?"
    assert (folder / "model.safetensors").read_bytes() == weights


def test_stale_folder_is_replaced(tmp_path):
    stale = tmp_path / "models" / "tiny-qwen2"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    assert materialize("tiny-qwen2", root=tmp_path) == stale
    assert json.loads((stale / "config.json").read_text()) == BUILTIN_MODELS["tiny-qwen2"]
    assert [p.name for p in stale.parent.iterdir()] == ["tiny-qwen2"]


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_tokenizer_round_trips_text_exactly(root, name):
    tokenizer = load_tokenizer(str(materialize(name, root=root)))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert ids == [CHAR_VOCAB.index(c) for c in TEXT]
    assert tokenizer.decode(ids) == TEXT
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.decode([*ids, 1, 0, 0], skip_special_tokens=True) == TEXT
    assert tokenizer.encode("ab<eos>", add_special_tokens=False) == [
        CHAR_VOCAB.index("a"),
        CHAR_VOCAB.index("b"),
        1,
    ]
    # Issue 18: a character outside the vocabulary (é, an emoji, NUL) reads as "?", never an error.
    assert (
        tokenizer.decode(tokenizer.encode("caf\u00e9 \U0001f389\x00!", add_special_tokens=False))
        == "caf? ??!"
    )
    batch = tokenizer(["ab", "abcd"], padding=True, padding_side="left", add_special_tokens=False)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1]


def test_autotokenizer_trap_is_avoided(qwen_dir):
    """transformers 5.23 gives a qwen2 folder a byte-level Qwen2Tokenizer that drops the spaces."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(qwen_dir)
    if auto.decode(auto.encode(" a b", add_special_tokens=False)) == " a b":
        pytest.skip("this transformers version loads the saved tokenizer correctly")
    assert load_tokenizer(str(qwen_dir)).decode(load_tokenizer(str(qwen_dir)).encode(" a b")) == " a b"


def test_a_tokenizer_that_does_not_round_trip_is_a_warning(tmp_path, capsys):
    """Issue 12: what is lost is reported (by check, from tokenizer.json), the tokenizer still loads."""
    from gpufleet.models.info import file_round_trip_note

    folder = tmp_path / "broken"
    tokenizer = bm.char_tokenizer()
    tokenizer.backend_tokenizer.decoder = None  # decoding now joins the characters with spaces
    tokenizer.save_pretrained(folder)
    loaded = load_tokenizer(str(folder))
    assert loaded.decode(loaded.encode("ab", add_special_tokens=False)) == "a b"
    note = file_round_trip_note(folder)
    assert note and "decodes as" in note and "reward functions see the decoded text" in note
    assert "warning" not in capsys.readouterr().err  # check already said it: not twice


def test_load_causal_lm(root):
    import torch

    qwen = load_causal_lm(str(materialize("tiny-qwen2", root=root)))
    llama = load_causal_lm(str(materialize("tiny-llama", root=root)), dtype="bfloat16")
    assert type(qwen).__name__ == "Qwen2ForCausalLM" and qwen.dtype == torch.float32
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.dtype == torch.bfloat16
    assert qwen.get_output_embeddings().weight is qwen.get_input_embeddings().weight
    assert llama.get_output_embeddings().weight is not llama.get_input_embeddings().weight
    assert qwen.config.vocab_size == len(CHAR_VOCAB)
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(str(materialize("tiny-qwen2", root=root)), dtype="float64")
