"""An example's phase on the rank pool's ranks, as ``torchrun --nproc-per-node N examples/x.py ...`` runs it.

Usage::

    out = run_example(ranks, 4, "examples/volume_unet3d.py", "--steps", "2")   # every rank exited 0; what they printed

Each rank runs the script as ``__main__`` (``runpy``) with torchrun's variables (``RANK``, ``WORLD_SIZE``, ...) and
``sys.argv`` set, in the checkout with ``examples/`` first on ``sys.path``. What the ranks print comes back in rank
order, rank 0's first (torchrun interleaves them). The pool restores the rank afterwards (rankpool/state.py). The
script's ``DistributedManager.initialize`` finds the pool's group (``launcher == "existing"``) and builds its mesh
on it.

NOTE: why not torchrun itself: a launch of 8 ranks spent 24 s of its wall time (42 s of the two cores) importing
torch, mesh3d and the example's libraries before the first step (measured on the sessions' 2-core EPYC), and the
examples' tests launched about 60 processes. The pool's ranks imported them once. What a launcher itself does is
tested where it is the point: tests/test_launch_integration.py, the Lightning and SLURM examples, scripts/demo.sh.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Seconds a phase may take before it counts as hung (a bound on a hang, not a speed limit).
TIMEOUT_S = 600.0


def run_example(ranks: Any, n: int, script: str, *argv: str, timeout: float = TIMEOUT_S) -> str:
    """Run ``script`` with ``argv`` on ``n`` pooled ranks; their stdout, in rank order. Fails unless every rank exits
    with 0."""
    results = ranks.run(n, _run_script, script, list(argv), timeout=timeout)
    failed = {rank: code for rank, (code, _) in enumerate(results) if code != 0}
    assert not failed, f"{script} {' '.join(argv)} exited {failed} (rank: code); rank 0 printed:\n{results[0][1][-4000:]}"
    return "".join(printed for _, printed in results)


def _exit_code(exc: SystemExit) -> int:
    """What the process would have exited with (``sys.exit("message")`` prints it and exits with 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code)
    return 1


def _run_script(script: str, argv: list[str]) -> tuple[int, str]:
    """On each rank: the script as ``__main__``; (exit code, what it printed)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT / "examples"))
    saved_argv, sys.argv = sys.argv, [str(ROOT / script), *argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = _exit_code(exc)
    finally:
        sys.argv = saved_argv
    return code, out.getvalue()
