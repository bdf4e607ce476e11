"""Launch the clean-exit scenarios many times and count aborts (the check behind docs/troubleshooting.md).

Each run starts fresh processes that end without ``DistributedManager.shutdown()`` (tests/exit_scenarios.py):
a collective right before exit (torchrun, the manager makes the group), FSDP + tensor parallel + a domain conv
with a background save pending at exit (4 ranks), and an uncaught exception. A run passes when no rank aborts,
the exit statuses are the expected ones and, for ``mixed``, the pending save landed and loads equal to the
one-process twin.

    python scripts/exit_soak.py --runs 100                 # all scenarios in turn, 100 launches in all
    python scripts/exit_soak.py --runs 20 --scenario mixed
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from exit_scenarios import TinyField, launch  # noqa: E402  (a test helper module, not part of the package)

from mesh3d import checkpoint  # noqa: E402

#: scenario -> (world size, launched under torchrun, exit status expected)
PLAN = {"collective": (2, True, "zero"), "mixed": (4, False, "zero"), "raise": (2, True, "non-zero")}


def _save_landed(out: Path) -> bool:
    torch.set_default_dtype(torch.float64)
    try:
        restored = TinyField()
        checkpoint.load(out / "ckpt", restored)
    finally:
        torch.set_default_dtype(torch.float32)
    state = restored.state_dict()
    return all(torch.allclose(state[k], v, rtol=1e-12, atol=1e-14) for k, v in load_file(str(out / "twin.safetensors")).items())


def one_run(scenario: str) -> str:
    """'ok', or what went wrong."""
    world, torchrun, expect = PLAN[scenario]
    with tempfile.TemporaryDirectory(prefix="mesh3d-soak-") as tmp:
        done = launch(scenario, world, Path(tmp), torchrun=torchrun)
        if done.aborted:
            return "aborted\n" + done.output[-2000:]
        zero = all(code == 0 for code in done.returncodes)
        if zero != (expect == "zero"):
            return f"exit status {done.returncodes}\n" + done.output[-2000:]
        if scenario == "mixed" and not _save_landed(Path(tmp)):
            return "the pending save did not land"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--scenario", choices=[*PLAN, "all"], default="all")
    args = parser.parse_args()
    order = list(PLAN) if args.scenario == "all" else [args.scenario]
    tally: Counter = Counter()
    start = time.monotonic()
    for i in range(args.runs):
        scenario = order[i % len(order)]
        verdict = one_run(scenario)
        tally[(scenario, verdict.splitlines()[0])] += 1
        print(f"[{i + 1}/{args.runs}] {scenario}: {verdict}  ({time.monotonic() - start:.0f} s)", flush=True)
    print("\nscenario     result   runs")
    for (scenario, verdict), n in sorted(tally.items()):
        print(f"{scenario:12s} {verdict:8s} {n}")
    bad = sum(n for (_, verdict), n in tally.items() if verdict != "ok")
    print(f"{args.runs - bad} of {args.runs} runs exited cleanly")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
