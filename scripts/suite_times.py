#!/usr/bin/env python
"""Write where the suite's time goes into tests/README.md, from one whole run's durations.

A run of the README's test command with ``--durations-json`` (tests/durations.py) records every test's seconds
(setup, call and teardown: a pool start counts where it happens). This script turns that file into the section of
tests/README.md between ``<!-- suite-times: begin -->`` and ``<!-- suite-times: end -->``: the total, the files that
take the most, and the 20 heaviest tests, each with what it alone asserts (the first sentence of its docstring, or
its name where it has none).

Usage::

    scripts/test.sh --durations=20 --durations-json=times.json     # one whole run (about an hour on 2 cores)
    .venv/bin/python scripts/suite_times.py times.json --machine "2-core Intel Xeon, torch 2.13.0+cpu"
    .venv/bin/python scripts/suite_times.py times.json older.json ...   # the heavy list from the slowest of each test
    .venv/bin/python scripts/suite_times.py --check                 # every test the table names still exists
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "tests" / "README.md"
#: The tests a whole run starts first (tests/conftest.py), one node id a line: those of at least ``HEAVY_SECONDS``.
HEAVY_LIST = ROOT / "tests" / "heaviest.txt"
HEAVY_SECONDS = 10.0
BEGIN, END = "<!-- suite-times: begin -->", "<!-- suite-times: end -->"
HEAVIEST = 20


def _function(nodeid: str) -> tuple[Path, str]:
    path, _, rest = nodeid.partition("::")
    return ROOT / path, rest.split("[")[0].split("::")[-1]


#: The longest "asserts" cell, in characters.
_LONGEST = 200


def what_it_asserts(nodeid: str) -> str:
    """The first sentence of the test function's docstring, else its name in words."""
    path, name = _function(nodeid)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            doc = ast.get_docstring(node)
            if doc:
                first = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0].rstrip(".")
                # NOTE: a sentence, not its label: "The whole example: 8 ranks ..." says what it runs after the colon
                return first if len(first) <= _LONGEST else first[:_LONGEST - 3].rstrip() + "..."
            break
    return name.removeprefix("test_").replace("_", " ")


def exists(nodeid: str) -> bool:
    path, name = _function(nodeid)
    return path.exists() and re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", path.read_text(), re.M) is not None


def section(times: dict, machine: str) -> str:
    tests: dict[str, float] = times["tests"]
    files: dict[str, float] = times["files"]
    total = sum(tests.values())
    lines = [BEGIN, "", f"One whole run ({len(tests)} tests, {total / 60:.0f} minutes in tests; {machine}; "
             "`scripts/suite_times.py` wrote this from its `--durations-json`):", "",
             "| file | seconds | share |", "|---|---:|---:|"]
    for path, seconds in list(files.items())[:10]:
        lines.append(f"| `{path}` | {seconds:.0f} | {100 * seconds / total:.1f} % |")
    lines += ["", f"The {HEAVIEST} heaviest tests, and what each one alone asserts:", "",
              "| test | seconds | asserts |", "|---|---:|---|"]
    for nodeid, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:HEAVIEST]:
        lines.append(f"| `{nodeid}` | {seconds:.0f} | {what_it_asserts(nodeid)} |")
    return "\n".join([*lines, "", END])


def heavy_list(times: dict, machine: str) -> str:
    """tests/heaviest.txt: every test of at least ``HEAVY_SECONDS`` in this run, heaviest first."""
    heavy = [n for n, sec in sorted(times["tests"].items(), key=lambda kv: -kv[1]) if sec >= HEAVY_SECONDS]
    head = [f"# Tests of at least {HEAVY_SECONDS:.0f} s in one whole run ({machine}), which a run starts first so that no",
            "# worker ends on one while the other waits (tests/conftest.py); scripts/suite_times.py writes this file."]
    return "\n".join([*head, *heavy]) + "\n"


def listed_heavy() -> list[str]:
    if not HEAVY_LIST.exists():
        return []
    return [line for line in HEAVY_LIST.read_text().splitlines() if line and not line.startswith("#")]


def named_tests(text: str) -> list[str]:
    body = text.split(BEGIN, 1)[1].split(END, 1)[0] if BEGIN in text else ""
    return re.findall(r"^\| `(tests/[^`]+::[^`]+)` \|", body, re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="*", help="a run's --durations-json file (the table); more runs' files widen "
                        "tests/heaviest.txt to every test that took HEAVY_SECONDS in any of them")
    parser.add_argument("--machine", default="2 cores", help="where it ran, for the section's first line")
    parser.add_argument("--check", action="store_true", help="exit 1 if the table names a test that no longer exists")
    args = parser.parse_args(argv)
    text = README.read_text()
    if args.check:
        gone = [t for t in dict.fromkeys(named_tests(text) + listed_heavy()) if not exists(t)]
        for t in gone:
            print(f"tests/README.md or tests/heaviest.txt names {t}, which no longer exists: rerun "
                  "scripts/suite_times.py", file=sys.stderr)
        return 1 if gone else 0
    if not args.json:
        parser.error("give the --durations-json file of a whole run (or --check)")
    runs = [json.loads(Path(path).read_text()) for path in args.json]
    new = section(runs[0], args.machine)
    slowest = {name: max(run["tests"].get(name, 0.0) for run in runs) for name in runs[0]["tests"]}
    HEAVY_LIST.write_text(heavy_list({"tests": slowest}, args.machine + (f", the slowest of {len(runs)} runs"
                                                                           if len(runs) > 1 else "")))
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + new + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Where the suite's time goes\n\n" + new + "\n"
    README.write_text(text)
    print(f"wrote tests/README.md's suite times ({len(named_tests(text))} tests named) and tests/heaviest.txt "
          f"({len(listed_heavy())} tests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
