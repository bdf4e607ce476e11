#!/usr/bin/env python
"""Multi-rank checks on one GPU: N ranks share it over staged gloo (``initialize(backend="gloo", device="cuda")``).

NCCL refuses two ranks on one GPU, so a one-GPU machine checks mesh3d's multi-rank CUDA code this way: the halo
exchanges and the ring on device tensors, compiled graphs with the exchange op at D>1, FSDP and TP on CUDA shards,
``async_save`` of CUDA state, the peer watch with CUDA work in flight. Every message goes through pinned host buffers
(mesh3d/staged_gloo); NCCL itself is not exercised (docs/benchmarks.md, "On a GPU").

This launches its own ranks (one process each, the "env" launcher: RANK, WORLD_SIZE, MASTER_ADDR...), in two jobs:

* ``fresh``: ``initialize(1, N, 1, backend="gloo", device="cuda")`` makes the job's default group itself; then the
  checks of ``scripts/gpu_rank_checks.py`` in order: manager, domain, unet, ring, compile, async_save, compose on
  (1, N, 1), and last kill (the last rank SIGKILLs itself; the others must name it);
* ``shapes``: the ranks make a gloo default group, the manager builds staged meshes on it: compose on (N, 1, 1) and
  (1, 1, N) (FSDP + TP + domain, each against one process).

Each check prints PASS/FAIL with its figure; the report (every check, every rank's staging figures, seconds per job)
goes to ``gpu_ranks_N.json`` in ``--out``. ``--device cpu`` runs the same logic on CPU (the staged groups pass CPU
tensors to gloo as they are): the suite's smoke test of this script.

Usage::

    python scripts/gpu_check.py --ranks 2           # the same as: python scripts/gpu_ranks.py --ranks 2
    python scripts/gpu_ranks.py --ranks 3 --out /tmp/gpu
    python scripts/gpu_ranks.py --ranks 2 --device cpu --checks manager,kill --compile-backend aot_eager
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpu_rank_checks import Context, rank_checks  # noqa: E402
from mesh3d import DistributedManager, WatchSettings  # noqa: E402

__all__ = ["launch_ranks", "main"]

#: The order checks run in; ``kill`` last (the job has lost a rank afterwards).
ORDER = ("manager", "domain", "unet", "ring", "compile", "async_save", "compose", "kill")
#: Bounds every collective of the checks: a hang ends as a timeout, not a stuck job.
GROUP_TIMEOUT_S = 60.0
#: The peer watch, short: a killed rank is named within seconds.
WATCH = WatchSettings(interval=0.25, suspect_after=1.0, dead_after=4.0, grace=2.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(phase: str, device: str, checks: list[str], folder: str, compile_backend: str) -> None:
    """One rank of one job: run its checks, write ``{phase}-rank{r}.json`` in ``folder``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "gloo" if device == "cuda" else "gloo_staged"  # NOTE: on CPU, name the staged groups explicitly
    results: dict[str, str] = {}
    file = Path(folder, f"{phase}-rank{rank}.json")
    if phase == "fresh":
        dm = DistributedManager.initialize(1, world, 1, backend=backend, device=device, timeout=GROUP_TIMEOUT_S,
                                           watch=WATCH)
        shape = tuple(dm.mesh.shape)

        def named(ran: dict[str, str]) -> dict[str, str]:
            return {(f"compose {shape}" if k == "compose" else k): v for k, v in ran.items()}

        # NOTE: written after every check: the rank the kill check kills has told its earlier results
        results = named(rank_checks(checks, Context(torch.device(device), folder, compile_backend),
                                    lambda ran: file.write_text(json.dumps(named(ran)))))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=rank, world_size=world)
        for shape in ((world, 1, 1), (1, 1, world)):
            dm = DistributedManager.initialize(*shape, backend=backend, device=device, timeout=GROUP_TIMEOUT_S,
                                               watch=WATCH)
            ran = rank_checks(["compose"], Context(torch.device(device), folder, compile_backend))
            results[f"compose {shape}"], results["staging"] = ran["compose"], ran["staging"]
            DistributedManager.shutdown()
    file.write_text(json.dumps(results))
    if "kill" in checks:
        os._exit(0)  # NOTE: a peer is gone: skip the teardown's wait for it
    DistributedManager.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_job(phase: str, ranks: int, device: str, checks: list[str], folder: str, compile_backend: str,
             timeout_s: float) -> tuple[dict[int, dict], dict[int, int | None]]:
    """Start the ranks of one job, wait for them (killing what outlives ``timeout_s``); per-rank results, exit codes."""
    port = _free_port()
    procs = []
    for r in range(ranks):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, __file__, "--worker", phase, "--device", device, "--checks", ",".join(checks),
               "--folder", folder, "--compile-backend", compile_backend]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int | None] = {}
    for r, proc in enumerate(procs):
        try:
            codes[r] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes[r] = None
    results = {}
    for r in range(ranks):
        file = Path(folder, f"{phase}-rank{r}.json")
        results[r] = json.loads(file.read_text()) if file.exists() else {}
    return results, codes


def _merge(name: str, results: dict[int, dict], codes: dict[int, int | None], victim: int | None) -> str:
    """One line for ``name``: PASS with rank 0's figure when every rank passed, else the first failure."""
    for r, got in results.items():
        if r == victim and name == "kill":
            if codes[r] != -signal.SIGKILL:
                return f"FAIL rank {r} should have died of SIGKILL, exit code {codes[r]}"
            continue
        line = got.get(name)
        if line is None:
            why = "timed out" if codes[r] is None else f"exit code {codes[r]}"
            return f"FAIL rank {r} reported nothing ({why}; its output is above)"
        if not line.startswith("PASS"):
            return f"{line} (rank {r})"
    first = next(r for r in results if r != victim)
    return results[first][name]


def launch_ranks(ranks: int, device: str = "cuda", checks: list[str] | None = None, out: str = ".",
                 compile_backend: str = "inductor", timeout_s: float = 300.0) -> dict:
    """Run the checks on ``ranks`` local ranks sharing this machine's GPU (or CPU); print and return the report."""
    unknown = sorted(set(checks or ORDER) - set(ORDER))
    if ranks < 2 or unknown:
        raise ValueError(f"launch_ranks: ranks={ranks} (at least 2), unknown checks {unknown}; choose from {ORDER}")
    checks = [c for c in ORDER if c in (checks or ORDER)]
    report: dict = {"ranks": ranks, "device": device, "torch": torch.__version__, "checks": {}, "staging": {},
                    "seconds": {}}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    Path(out).mkdir(parents=True, exist_ok=True)
    compose = lambda *shapes: [f"compose {shape}" for shape in shapes]  # noqa: E731 - the report's names
    jobs = [("fresh", checks, [n for c in checks for n in (compose((1, ranks, 1)) if c == "compose" else [c])])]
    if "compose" in checks:
        jobs.append(("shapes", ["compose"], compose((ranks, 1, 1), (1, 1, ranks))))
    for phase, names, lines in jobs:
        with tempfile.TemporaryDirectory(dir=out) as folder:
            start = time.monotonic()
            results, codes = _run_job(phase, ranks, device, names, folder, compile_backend, timeout_s)
            report["seconds"][phase] = round(time.monotonic() - start, 1)
        victim = ranks - 1 if "kill" in names else None
        for name in lines:
            report["checks"][name] = line = _merge(name, results, codes, victim)
            print(f"{name:<24} {line}", flush=True)
        report["staging"][phase] = {r: got.get("staging") for r, got in results.items() if r != victim}
        (Path(out) / f"gpu_ranks_{ranks}.json").write_text(json.dumps(report, indent=1))  # a run cut short keeps these
    report["seconds"]["total"] = round(sum(report["seconds"].values()), 1)
    failed = [k for k, v in report["checks"].items() if not v.startswith("PASS")]
    print(f"{ranks} ranks on one {device}: {len(report['checks']) - len(failed)} passed, {len(failed)} failed, "
          f"{report['seconds']['total']} s")
    (Path(out) / f"gpu_ranks_{ranks}.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks sharing the device (at least 2)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--checks", default=",".join(ORDER), help=f"comma-separated, from {','.join(ORDER)}")
    parser.add_argument("--out", default=".", help="folder for gpu_ranks_N.json")
    parser.add_argument("--compile-backend", default="inductor", help="Dynamo backend of the compile check")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take before it is killed")
    parser.add_argument("--worker", choices=("fresh", "shapes"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    if args.worker:
        _worker(args.worker, args.device, checks, args.folder, args.compile_backend)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu to run the logic on CPU")
        return 1
    report = launch_ranks(args.ranks, args.device, checks, args.out, args.compile_backend, args.timeout)
    return 0 if all(v.startswith("PASS") for v in report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
