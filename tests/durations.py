"""pytest plugin: where the suite's time goes. With ``--durations=N`` (pytest's own option: the N slowest tests), the
summary also shows every file's total (setup, call and teardown of its tests: a pool start counts where it happens);
``--durations-json=PATH`` writes every test's and every file's seconds, for tests/README.md's table of the heaviest.

Usage::

    scripts/test.sh --durations=20                             # the 20 slowest tests, then every file's total
    scripts/test.sh --durations=0 --durations-json=times.json  # every test, and the JSON
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

_TESTS: dict[str, float] = defaultdict(float)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-json", metavar="PATH", default=None,
                     help="write every test's and every file's seconds (setup + call + teardown) to PATH")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _TESTS[report.nodeid] += report.duration


def _files() -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _TESTS.items():
        files[nodeid.split("::")[0]] += seconds
    return dict(sorted(files.items(), key=lambda kv: -kv[1]))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.getoption("durations", None) is None or not _TESTS:
        return
    files, total = _files(), sum(_TESTS.values())
    terminalreporter.write_sep("=", f"seconds per file ({len(files)} files, {total:.0f} s in tests)")
    for path, seconds in files.items():
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {path}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("durations_json", None)
    if path:
        with open(path, "w") as f:
            json.dump({"files": _files(), "tests": dict(sorted(_TESTS.items(), key=lambda kv: -kv[1]))}, f, indent=1)
