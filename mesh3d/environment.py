"""What ``mesh3d info`` reports: torch, its backends and devices, and the launcher this process sees.

Imports torch and ``torch.distributed`` only (not the compiler stack): ``mesh3d info`` answers in about the time
``import torch`` takes.

Usage::

    for key, value in environment_report().items():
        print(key, value)
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.distributed as dist

import mesh3d
from mesh3d.launcher import detect_launcher

__all__ = ["TESTED_TORCH", "environment_report", "run_info"]

#: The oldest and newest torch mesh3d is tested on (pyproject's floor is the first). 2.13.0 is the
#: local CPU wheel CI uses; 2.14.1 (a CUDA build, run on the CPU) installs from this machine's wheel
#: cache: ``TORCH_PIN=torch==2.14.1 MESH3D_VENV=.venv-214 scripts/test.sh``. Older releases would be
#: multi-GB CUDA downloads here, so they are not claimed.
TESTED_TORCH: tuple[str, str] = ("2.13.0", "2.14.1")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def environment_report() -> dict[str, str]:
    """What ``mesh3d info`` prints, as ordered key/value pairs.

    Usage: ``environment_report()["torch"]``
    """
    backends = [name for name in ("gloo", "nccl", "mpi", "ucc") if getattr(dist, f"is_{name}_available", lambda: False)()]
    try:
        info = detect_launcher()
        launcher = f"{info.launcher} (rank {info.rank} of {info.world_size}, local rank {info.local_rank})"
        if info.master_addr:
            launcher += f", rendezvous {info.master_addr}:{info.master_port}"
    except ValueError as err:
        launcher = f"misconfigured: {err}"
    cuda = torch.cuda.is_available()
    low, high = TESTED_TORCH
    inside = _release(low) <= _release(torch.__version__) <= _release(high)
    return {
        "mesh3d": mesh3d.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "tested torch": f"{low} to {high} ({'this one is inside' if inside else 'this one is OUTSIDE'} the tested range)",
        "distributed": "available" if dist.is_available() else "unavailable",
        "backends": ", ".join(backends) or "none",
        "cuda": f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}" if cuda else "not available",
        "default backend": "nccl" if cuda else "gloo",
        "launcher": launcher,
    }


def run_info(args: argparse.Namespace) -> int:
    """``mesh3d info``: the report above, one aligned line per key.

    Usage: ``run_info(argparse.Namespace())``
    """
    report = environment_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")
    return 0
