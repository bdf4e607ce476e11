"""How mesh3d's process groups are set up: the collective timeout, the backend and the device of each rank.

Usage::

    timeout = as_timeout(None)                  # MESH3D_TIMEOUT seconds, else DEFAULT_TIMEOUT (10 minutes)
    backend = choose_backend(None)              # "nccl" with CUDA, else "gloo"
    device = choose_device(backend, local_rank) # cuda:local_rank % GPUs, or cpu
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

__all__ = ["DEFAULT_TIMEOUT", "as_timeout", "choose_backend", "choose_device"]

#: Collectives that wait longer than this raise instead of hanging the job. Ten minutes
#: is NCCL's default; gloo's own default is 30 minutes, too long to notice a hang.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_MESH3D_TIMEOUT_ENV = "MESH3D_TIMEOUT"


def as_timeout(timeout: float | timedelta | None) -> timedelta:
    """``timeout`` as a timedelta; None reads ``MESH3D_TIMEOUT`` (seconds), else ``DEFAULT_TIMEOUT``."""
    if timeout is None:
        env = os.environ.get(_MESH3D_TIMEOUT_ENV)
        if env is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"{_MESH3D_TIMEOUT_ENV}={env!r} must be a number of seconds") from None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or a timedelta")
    return timeout


def choose_backend(backend: str | None) -> str:
    """``backend``, checked against this machine; None picks nccl with CUDA, else gloo."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend and not torch.cuda.is_available():
        raise ValueError(
            f"backend={backend!r} needs CUDA, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); use backend='gloo' for CPU, or leave backend=None to choose automatically"
        )
    return backend


def choose_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its GPU for nccl, else the CPU."""
    if "nccl" in backend:
        # Map local ranks onto visible GPUs; more ranks than GPUs on a node shares them round-robin.
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
