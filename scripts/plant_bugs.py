#!/usr/bin/env python
"""Plant known silent bugs, one at a time, and ask whether the tests catch each by an assertion (issue 63).

The suite's power to catch is measured outside it: each mutant is an exact replacement in one source file that
makes the code silently wrong (a wrong number, not a crash), with the test files that should catch it. For each,
this script checks out a commit into a scratch worktree, plants the mutant, runs those files and records the
verdict:

- ``caught``: a test failed on an assertion (or on any error other than a timeout);
- ``timeout``: the only failures were timeouts (a rank pool's ``RankTimeout``, or this script's own limit): caught
  late, by waiting, which the issue counts as a loss;
- ``missed``: every test passed with the bug in place;
- ``n/a``: the replaced text is not in that commit (the code moved).

Each file set also runs once without a mutant (``baseline``), which must pass for the verdicts to mean anything.
Run it on the commit before a change to the tests and on the change itself: the number caught must not fall.

Usage::

    .venv/bin/python scripts/plant_bugs.py scripts/mutants.json                      # HEAD
    .venv/bin/python scripts/plant_bugs.py scripts/mutants.json --commit 47575b6 --only forecast_key_ignores_init
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tree: Path, tests: list[str], timeout: int) -> tuple[str, str]:
    """(verdict-ish outcome, the output's tail) of the test files in ``tree`` (mesh3d imported from there)."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + str(tree / "tests"))
    command = [sys.executable, "-m", "pytest", *tests, "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"no answer in {timeout} s"
    out = done.stdout + done.stderr
    if done.returncode == 0:
        return "passed", out[-300:]
    if done.returncode != 1:
        return "error", out[-1500:]
    timed_out = "RankTimeout" in out and "AssertionError" not in out
    return ("timeout" if timed_out else "failed"), out[-1500:]


def measure(mutants: list[dict], commit: str, timeout: int) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="plant-bugs-"))
    tree = scratch / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), commit], check=True,
                   capture_output=True)
    report: dict = {"commit": subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], check=True,
                                             capture_output=True, text=True).stdout.strip(), "baseline": {}, "mutants": []}
    try:
        for tests in dict.fromkeys(tuple(m["tests"]) for m in mutants):
            start = time.perf_counter()
            outcome, tail = _pytest(tree, list(tests), timeout)
            report["baseline"][" ".join(tests)] = outcome
            print(f"baseline {' '.join(tests)}: {outcome} ({time.perf_counter() - start:.0f} s)", flush=True)
            if outcome != "passed":
                print(tail, flush=True)
        for m in mutants:
            path = tree / m["file"]
            text = path.read_text() if path.exists() else ""
            if text.count(m["old"]) != 1:
                report["mutants"].append({"name": m["name"], "verdict": "n/a"})
                print(f"{m['name']}: n/a (the text is not once in {m['file']} at this commit)", flush=True)
                continue
            path.write_text(text.replace(m["old"], m["new"]))
            start = time.perf_counter()
            try:
                outcome, tail = _pytest(tree, m["tests"], timeout)
            finally:
                path.write_text(text)
            verdict = {"passed": "missed", "failed": "caught", "error": "caught", "timeout": "timeout"}[outcome]
            report["mutants"].append({"name": m["name"], "verdict": verdict, "seconds": round(time.perf_counter() - start)})
            print(f"{m['name']}: {verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    report["caught"] = sum(m["verdict"] == "caught" for m in report["mutants"])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", help="a JSON list of {name, file, old, new, tests, why}")
    parser.add_argument("--commit", default="HEAD", help="the commit to plant them in (default HEAD)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one run of a mutant's test files")
    parser.add_argument("--only", help="comma-separated names: plant only these")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    mutants = json.loads(Path(args.mutants).read_text())
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {m["name"] for m in mutants}
        if unknown:
            parser.error(f"--only {', '.join(sorted(unknown))}: not in {args.mutants} (its names: "
                         f"{', '.join(m['name'] for m in mutants)})")
        mutants = [m for m in mutants if m["name"] in names]
    report = measure(mutants, args.commit, args.timeout)
    print(f"{report['commit']}: {report['caught']} of {len(mutants)} caught by an assertion; "
          + ", ".join(f"{m['name']} {m['verdict']}" for m in report["mutants"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(v == "passed" for v in report["baseline"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
