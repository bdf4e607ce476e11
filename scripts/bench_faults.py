"""Time-to-error of every fault cell (tests/fault_cells.py), repeated: how long after one rank of three is killed,
raises or hangs each survivor raises the named error, and how many runs ended in a hang (none may).

Usage::

    python scripts/bench_faults.py --repeats 5                  # all 18 cells, 5 runs each (~12 min on 2 cores)
    python scripts/bench_faults.py --repeats 20 --cells halo-kill,fsdp-raise
    python scripts/bench_faults.py --cells none --divergence 20   # only: ranks that diverge, 20 runs

Writes docs/benchmarks/faults.json and prints the markdown table that docs/benchmarks.md shows. Progress goes
to stderr, one line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fault_cells import ACTIONS, GROUP_TIMEOUT_S, POINTS, WATCH, bound_s, check_outcome, divergence_runs, run_cell  # noqa: E402
from rankpool.pool import RankPool, RankTimeout  # noqa: E402

from bench_common import cpu_model  # noqa: E402
from bench_report import faults_table  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks", "faults.json")


def _run_cells(cells: list[tuple[str, str]], repeats: int) -> list[dict]:
    rows = []
    pool = RankPool(3)
    try:
        with tempfile.TemporaryDirectory() as root:
            for point, action in cells:
                seconds, kinds, named, hangs, runs = [], {}, 0, 0, 0
                for i in range(repeats):
                    started = time.monotonic()
                    try:
                        outcomes = run_cell(pool.run, root, point, action, f"{point}-{action}-{i}")
                    except RankTimeout:
                        hangs += 1
                        continue
                    runs += 1
                    for rank, out in outcomes.items():
                        try:
                            check_outcome(rank, out, action, point)
                            in_bound = out["error"] == "exit" or out["seconds"] < bound_s(action)
                            named += in_bound  # named, within the documented bound
                        except AssertionError:
                            pass
                        kinds[out["error"]] = kinds.get(out["error"], 0) + 1
                        seconds.append(out["seconds"] if out["seconds"] is not None else time.monotonic() - started)
                    print(f"{point}-{action} run {i + 1}/{repeats}: "
                          + ", ".join(f"rank {r} {o['error']}" for r, o in sorted(outcomes.items())), file=sys.stderr)
                rows.append({"cell": f"{point}-{action}", "runs": runs, "survivors": 2 * runs, "named": named,
                             "hangs": hangs, "errors": kinds, "p50_s": statistics.median(seconds) if seconds else None,
                             "max_s": max(seconds) if seconds else None})
    finally:
        pool.close()
    return rows


def _divergence(runs: int) -> dict:
    """Runs of three ranks (5, 4, 4) whose model branches on the local shape: in how many every rank named it."""
    if not runs:
        return {"runs": 0, "named_on_every_rank": 0}
    pool = RankPool(3)
    try:
        outcomes = divergence_runs(pool.run, runs)
    finally:
        pool.close()
    every = sum(all(kind == "DomainDivergenceError" for kind, _ in run) for run in outcomes)
    print(f"divergence: named on every rank in {every} of {runs} runs", file=sys.stderr)
    return {"runs": runs, "named_on_every_rank": every,
            "kinds": [[kind for kind, _ in run] for run in outcomes]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cells", default="", help="comma-separated point-action cells (default: all)")
    parser.add_argument("--divergence", type=int, default=20, help="runs of three ranks that diverge (0: none)")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    cells = [(p, a) for p in POINTS for a in ACTIONS]
    if args.cells == "none":
        cells = []
    elif args.cells:
        wanted = set(args.cells.split(","))
        unknown = wanted - {f"{p}-{a}" for p, a in cells}
        if unknown:
            parser.error(f"unknown cells {sorted(unknown)}; choose from {', '.join(f'{p}-{a}' for p, a in cells)}")
        cells = [(p, a) for p, a in cells if f"{p}-{a}" in wanted]
    rows = _run_cells(cells, args.repeats)
    diverged = _divergence(args.divergence)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_model(), "settings": {"watch": WATCH, "group_timeout_s": GROUP_TIMEOUT_S, "ranks": 3, "victim": 1},
                   "cells": rows, "divergence": diverged}, f, indent=1)
    print("\n".join(faults_table(rows)))


if __name__ == "__main__":
    main()
