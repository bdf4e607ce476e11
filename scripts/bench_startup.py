"""Benchmark what a process pays before its first step: importing mesh3d as a rank does, and an autograd Function call.

Usage::

    python scripts/bench_startup.py                    # ~1 min on 2 cores
    python scripts/bench_startup.py --repeats 3 --out /tmp/startup.json    # a smoke run

Every rank, launcher, CLI call and example starts a fresh interpreter. Each contender below is a new process, timed from
its start to its exit (wall and CPU), the contenders taking turns round by round, each keeping its median:

- ``torch``: ``import torch`` alone, the floor;
- ``mesh3d rank``: ``from mesh3d import DistributedManager`` and ``import mesh3d.domain``, then one domain tensor made
  (what a domain rank imports before its first op);
- ``mesh3d rank, compiler stack loaded``: the same, plus ``torch._dynamo`` and ``torch.distributed.tensor`` imported,
  which mesh3d itself imported until 2026-12-07 (what it costs a rank that does not compile or use DTensor).

Then one call of an autograd Function of the ``setup_context`` form (as each mesh3d exchange, reduction and norm is),
with mesh3d's routing of ``Function.apply`` installed (a domain tensor alive) and without it (torch's own apply).
Writes docs/benchmarks/startup.json and startup.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import cpu_model  # noqa: E402

_RANK = ("from mesh3d import DistributedManager, domain\nimport torch\n"
         "x = domain.shard(torch.zeros(4, 3), dim=0)\n")
CONTENDERS = {
    "torch": "import torch\n",
    "mesh3d rank": _RANK,
    "mesh3d rank, compiler stack loaded": _RANK + "import torch._dynamo, torch.distributed.tensor\n",
}

_FUNCTION_CALL = r'''
import sys, timeit, torch
torch.set_num_threads(1)
if sys.argv[1] == "routed":
    from mesh3d import domain
    keep = domain.shard(torch.zeros(4, 3), dim=0)  # a live domain tensor: mesh3d routes Function.apply
    assert getattr(torch.autograd.Function.apply, "_mesh3d_routed", False)

class Scale(torch.autograd.Function):
    @staticmethod
    def forward(x, factor, dim, plan):
        return x * factor

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None, None, None

x = torch.randn(4, requires_grad=True)
n = 20000
print(min(timeit.repeat(lambda: Scale.apply(x, 2.0, 0, None), number=n, repeat=5)) / n * 1e6)
'''


def _time_process(code: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a fresh interpreter running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def startup(repeats: int) -> dict:
    """Each contender's median wall and CPU seconds, the contenders taking turns."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CONTENDERS}
    for r in range(repeats):
        for name, code in CONTENDERS.items():
            runs[name].append(_time_process(code))
        print(f"  round {r + 1}/{repeats}", flush=True)
    return {name: {"wall_s": statistics.median(w for w, _ in got), "cpu_s": statistics.median(c for _, c in got)}
            for name, got in runs.items()}


def function_call() -> dict:
    """us per call of a setup_context Function: torch's own apply, and mesh3d's routed one (each a fresh process)."""
    out = {}
    for mode in ("torch", "routed"):
        done = subprocess.run([sys.executable, "-c", _FUNCTION_CALL, mode], check=True, cwd=ROOT, capture_output=True,
                              text=True)
        out[mode] = float(done.stdout.strip().splitlines()[-1])
    return out


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415 (optional: the plot only)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: the plot only)
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    names = list(report["startup"])
    a.barh(names, [report["startup"][n]["wall_s"] for n in names], color=["#999", "#2a7", "#c55"])
    a.set_xlabel("seconds from start to exit (median)")
    a.set_title("a fresh process")
    calls = report["function_call_us"]
    b.barh(["torch's Function.apply", "mesh3d's routed apply"], [calls["torch"], calls["routed"]], color=["#999", "#2a7"])
    b.set_xlabel("us per call of a setup_context Function")
    b.set_title("one autograd Function call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds of fresh processes (each contender once a round)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "startup.json")
    args = parser.parse_args(argv)
    report = {"machine": cpu_model(), "torch": torch.__version__, "repeats": args.repeats,
              "startup": startup(args.repeats), "function_call_us": function_call()}
    floor = report["startup"]["torch"]["wall_s"]
    for name, got in report["startup"].items():
        print(f"  {name:36s} {got['wall_s']:.2f} s wall, {got['cpu_s']:.2f} s CPU ({got['wall_s'] / floor:.2f}x torch)")
    calls = report["function_call_us"]
    print(f"  Function call: torch's apply {calls['torch']:.1f} us, routed {calls['routed']:.1f} us "
          f"({calls['routed'] / calls['torch']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
