"""scripts/suite_times.py: tests/README.md's table of where the suite's time goes, from a run's durations."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "suite_times.py"
_SPEC = importlib.util.spec_from_file_location("suite_times", _PATH)  # a script, not a package: loaded by path
suite_times = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(suite_times)


def test_the_table_names_the_heaviest_tests_with_what_each_asserts(tmp_path, monkeypatch):
    durations = {
        "tests": {"tests/test_suite_times.py::test_the_table_names_the_heaviest_tests_with_what_each_asserts": 1.5,
                  "tests/test_cli.py::test_version_and_help_import_no_torch_and_info_no_compiler_stack": 0.5,
                  "tests/test_suite_times.py::test_every_test_the_readme_names_still_exists[x]": 9.0},
        "files": {"tests/test_suite_times.py": 10.5, "tests/test_cli.py": 0.5}}
    readme = tmp_path / "README.md"
    readme.write_text("# Writing tests\n\nText kept.\n")
    monkeypatch.setattr(suite_times, "README", readme)
    heavy = tmp_path / "heaviest.txt"
    monkeypatch.setattr(suite_times, "HEAVY_LIST", heavy)
    monkeypatch.setattr(suite_times, "HEAVY_SECONDS", 1.0)
    path = tmp_path / "times.json"
    path.write_text(json.dumps(durations))
    assert suite_times.main([str(path), "--machine", "a test"]) == 0
    text = readme.read_text()
    assert text.startswith("# Writing tests\n\nText kept.\n") and "3 tests, 0 minutes in tests; a test" in text
    rows = [line for line in text.splitlines() if line.startswith("| `tests/") and "::" in line]
    # heaviest first; the first sentence of a docstring, else the name in words
    assert rows[0].startswith("| `tests/test_suite_times.py::test_every_test_the_readme_names_still_exists[x]` | 9 |")
    assert rows[0].endswith("| Each test the README's table names is a test of the checkout |")
    assert rows[1].endswith("| the table names the heaviest tests with what each asserts |")
    assert suite_times.named_tests(text)[0].endswith("still_exists[x]")
    # the tests a run starts first (tests/conftest.py): those of at least HEAVY_SECONDS, heaviest first
    assert suite_times.listed_heavy() == [
        "tests/test_suite_times.py::test_every_test_the_readme_names_still_exists[x]",
        "tests/test_suite_times.py::test_the_table_names_the_heaviest_tests_with_what_each_asserts"]
    assert suite_times.main(["--check"]) == 0
    readme.write_text(text.replace("test_cli.py::test_version_and", "test_cli.py::test_no_such"))  # a renamed test
    assert suite_times.main(["--check"]) == 1
    suite_times.main([str(path)])  # rewritten in place: one section, not two
    assert readme.read_text().count(suite_times.BEGIN) == 1


def test_every_test_the_readme_names_still_exists():
    """Each test the README's table names is a test of the checkout. A renamed or merged test shows here, so the
    table is rewritten (scripts/suite_times.py) rather than left naming what is gone."""
    assert suite_times.main(["--check"]) == 0
