"""Random YAML, env and flags never raise anything but the clean error (exit 0 or 2, no traceback)."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet import datafile
from gpufleet.cli import main
from gpufleet.config.schema import SECTIONS, field_paths

PATHS = field_paths()
names = st.one_of(st.sampled_from(list(SECTIONS)), st.text(min_size=0, max_size=12))
fields = st.one_of(st.sampled_from([p.split(".", 1)[1] for p in PATHS]), st.text(max_size=12))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["auto", "colocate", "0,1", "[0, 1]", "builtin:repeat", "grpo", "1e-5", "-1"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
sections = st.dictionaries(names, st.one_of(values, st.dictionaries(fields, values, max_size=5)), max_size=6)
env_names = st.one_of(
    st.sampled_from(PATHS).map(lambda p: "GPUFLEET_" + p.upper().replace(".", "__")),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", max_size=20).map(lambda s: "GPUFLEET_" + s),
)
text_values = st.one_of(
    st.text(max_size=20), st.sampled_from(["4", "null", "auto", "0,1,2", "[1]", "true", "1e-3"])
)
flags = st.one_of(
    st.tuples(st.sampled_from(PATHS), text_values).map(lambda t: f"{t[0]}={t[1]}"),
    st.text(max_size=30),
)

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _run(tmp_path, capsys, text, env, sets, verb):
    (tmp_path / "job.yaml").write_text(text, encoding="utf-8", errors="surrogatepass")
    argv = [verb, str(tmp_path / "job.yaml")]
    for s in sets:
        argv += ["--set", s]
    if verb == "check":
        argv += ["--gpus", "cpu"]
    code = main(argv, env=env)
    out = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in out.out + out.err
    if code == 2 and not (out.out + out.err).strip():
        raise AssertionError("exit 2 without a message")


@SETTINGS
@given(
    doc=sections,
    env=st.dictionaries(env_names, text_values, max_size=4),
    sets=st.lists(flags, max_size=4),
    verb=st.sampled_from(["check", "config"]),
)
def test_random_structured_input(tmp_path, capsys, doc, env, sets, verb):
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    _run(tmp_path, capsys, text, env, sets, verb)


@SETTINGS
@given(text=st.text(max_size=200))
def test_random_text_as_job(tmp_path, capsys, text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return
    _run(tmp_path, capsys, text, {}, [], "check")


data_lines = st.one_of(
    st.binary(max_size=40),
    st.sampled_from(
        [
            b'{"prompt": "a"}',
            b'{"prompt": 1}',
            b"{not json",
            b'"a',
            b"prompt,x",
            b"a,b,c",
            b"\xff\xfe",
            b"[",
            b"]",
        ]
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(data_lines, max_size=6),
    suffix=st.sampled_from(datafile.FORMATS),
    keep=st.booleans(),
)
def test_random_data_file_bytes(tmp_path, lines, suffix, keep):
    """Any bytes in a data file: rows, or the one-line DataFileError; never another exception."""
    path = tmp_path / f"d{suffix}"
    path.write_bytes(b"\n".join(lines))
    try:
        found = datafile.scan(path, "prompt", keep=keep)
    except datafile.DataFileError as e:
        assert str(e).startswith("data.") and "\n" not in str(e)
    else:
        assert found.count >= 1 and "prompt" in found.columns
