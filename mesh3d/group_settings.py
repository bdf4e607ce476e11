"""How mesh3d's process groups are set up: the collective timeout, the backend and the device of each rank.

Usage::

    timeout = as_timeout(None)                  # MESH3D_TIMEOUT seconds, else DEFAULT_TIMEOUT (10 minutes)
    backend = choose_backend(None)              # "nccl" with CUDA, else "gloo"
    device = choose_device(backend, local_rank) # cuda:local_rank % GPUs, or cpu
    store = restart_store(timeout)              # under torchrun's shared store: this restart's own keys
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mesh3d.launcher import LaunchInfo

__all__ = ["DEFAULT_TIMEOUT", "as_timeout", "choose_backend", "choose_device", "init_default_group", "restart_store"]

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


def restart_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun with its rendezvous store shared (the default), a store for this restart's keys only; else None.

    NOTE: torchrun's agent keeps one TCPStore across restarts (TORCHELASTIC_USE_AGENT_STORE=True) and
    ``init_process_group`` keys it the same way every time, so after ``--max-restarts`` restarts the job, gloo reads
    the dead attempt's addresses and fails with "connectFullMesh ... Connection refused" (pytorch#135712; NCCL
    reads a stale unique id). The restart count, which torchrun gives every worker, prefixes this attempt's keys.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"mesh3d/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def init_default_group(info: LaunchInfo, backend: str, device: torch.device, timeout: timedelta) -> None:
    """Join the default process group as ``info`` (from ``detect_launcher``) describes this rank."""
    device_id = device if device.type == "cuda" else None  # CPU device_id is rejected by torch 2.13
    if info.world_size == 1 and info.master_addr is None:
        # A world of one needs no rendezvous: an in-process store avoids binding a port.
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, device_id=device_id)
        return
    store = restart_store(timeout)  # torchrun: this restart's keys (its shared store outlives a restart)
    dist.init_process_group(
        backend, init_method=None if store else f"tcp://{info.master_addr}:{info.master_port}", store=store,
        rank=info.rank, world_size=info.world_size, timeout=timeout, device_id=device_id)
