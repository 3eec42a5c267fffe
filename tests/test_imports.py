"""gpufleet.imports: where the user's `module:Name` / `file.py:Name` are found, checked and loaded."""

import sys

import pytest

from gpufleet import imports
from gpufleet.errors import UserError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_module_in_the_job_folder_is_found_without_running_it(tmp_path):
    write(
        tmp_path / "rw_found.py",
        "raise SystemExit('must not run')\ndef score(prompts, completions, **kw): ...\n",
    )
    why, node = imports.problem("rw_found:score", [str(tmp_path)])
    assert why is None and node.name == "score"


def test_a_misspelled_name_gets_did_you_mean(tmp_path):
    write(tmp_path / "rw_typo.py", "def reverse_match(prompts, completions, **kw): ...\n")
    why, _ = imports.problem("rw_typo:reverse_mach", [str(tmp_path)])
    assert "defines no 'reverse_mach'" in why and "did you mean 'reverse_match'" in why


def test_a_missing_module_names_the_folders_searched(tmp_path):
    why, _ = imports.problem("no_such_module_xyz:f", [str(tmp_path)])
    assert "no module 'no_such_module_xyz'" in why and str(tmp_path) in why


def test_a_path_where_a_module_is_expected_says_which_form(tmp_path):
    why, _ = imports.problem("rewards.my-file:f", [str(tmp_path)])
    assert "path/to/file.py:f" in why


def test_file_references_are_anchored_to_the_base_folder(tmp_path):
    assert imports.anchored("rewards/r.py:f", tmp_path) == f"{tmp_path / 'rewards' / 'r.py'}:f"
    assert imports.anchored("pkg.mod:f", tmp_path) == "pkg.mod:f"


def test_syntax_error_is_reported_with_its_line(tmp_path):
    f = write(tmp_path / "broken.py", "x = 1\ndef f(:\n")
    why, _ = imports.problem(f"{f}:f", [])
    assert f"{f}:2: syntax error" in why


def test_load_by_file_path_and_sibling_imports(tmp_path):
    write(tmp_path / "r" / "helper_mod_abc.py", "K = 3\n")
    f = write(
        tmp_path / "r" / "main_rw.py",
        "from helper_mod_abc import K\ndef f(prompts, completions, **kw):\n    return [K]\n",
    )
    fn = imports.load(f"{f}:f", [], "reward.functions")
    assert fn([], []) == [3]


def test_load_error_at_import_points_at_the_users_line(tmp_path):
    f = write(tmp_path / "raises_at_import.py", "import os\nvalue = undefined_name\n")
    with pytest.raises(UserError) as e:
        imports.load(f"{f}:f", [], "reward.functions")
    assert f"{f}:2: NameError" in str(e.value) and "reward.functions" in str(e.value.field)


def test_load_missing_attribute_suggests_the_close_one(tmp_path):
    write(tmp_path / "rw_attr_mod.py", "def accuracy(prompts, completions, **kw): ...\n")
    with pytest.raises(UserError) as e:
        imports.load("rw_attr_mod:acuracy", [str(tmp_path)], "reward.functions")
    assert "rw_attr_mod:accuracy" in e.value.fix
    sys.modules.pop("rw_attr_mod", None)


def test_pythonpath_puts_the_roots_first_once(tmp_path):
    assert imports.pythonpath(["/a", "/b"], {"PYTHONPATH": "/b:/c"}) == "/a:/b:/c"
