"""How mesh3d's process groups are set up: the collective timeout, the backend and the device of each rank.

Usage::

    timeout = as_timeout(None)                  # MESH3D_TIMEOUT seconds, else DEFAULT_TIMEOUT (10 minutes)
    backend = choose_backend(None)              # "nccl" with CUDA, else "gloo"
    device = choose_device(backend, local_rank) # cuda:local_rank % GPUs, or cpu
    backend, device = choose_transport("gloo", "cuda", local_rank, existing=None)  # ("gloo_staged", cuda:...)
    store = restart_store(timeout)              # under torchrun's shared store: this restart's own keys
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mesh3d.launcher import LaunchInfo
from mesh3d.staged_gloo import STAGED, STAGED_BACKEND

__all__ = ["DEFAULT_TIMEOUT", "as_timeout", "choose_backend", "choose_device", "choose_transport", "init_default_group",
           "restart_store"]

#: The device types ``initialize(device=...)`` takes.
DEVICE_TYPES = ("cpu", "cuda")

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


def choose_device(backend: str, local_rank: int, device_type: str | None = None) -> torch.device:
    """The device a rank computes on: ``device_type``, else its GPU for nccl (and gloo_staged with CUDA), else the CPU."""
    if device_type is None:
        cuda = "nccl" in backend or (backend == STAGED_BACKEND and torch.cuda.is_available())
        device_type = "cuda" if cuda else "cpu"
    if device_type == "cuda":
        # Map local ranks onto visible GPUs; more ranks than GPUs on a node shares them round-robin.
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _device_type(device: str | torch.device | None) -> str | None:
    """``device`` as "cpu" or "cuda" (None: chosen from the backend); anything else raises, naming the choices."""
    if isinstance(device, torch.device) and device.index is None:
        device = device.type
    if device is not None and device not in DEVICE_TYPES:
        raise ValueError(f"device={device!r} is not a device type mesh3d places ranks on; use one of {DEVICE_TYPES} "
                         "(CUDA ranks take cuda:LOCAL_RANK % torch.cuda.device_count()), or None")
    return device


def choose_transport(backend: str | None, device: str | torch.device | None, local_rank: int,
                     existing: str | None) -> tuple[str, torch.device]:
    """(the backend of the mesh's groups, this rank's device), checked before any collective.

    ``existing`` is the backend of a default group made before ``initialize`` (its backend is kept; a gloo one gets
    staged mesh groups for CUDA ranks). ``backend="gloo", device="cuda"`` is the staged gloo transport
    (``"gloo_staged"``, mesh3d/staged_gloo): several ranks may share one GPU, every device tensor goes through host
    buffers; for tests and machines without NCCL.
    """
    kind = _device_type(device)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device='cuda' needs CUDA, but torch.cuda.is_available() is False on this machine (torch "
                         f"{torch.__version__}); use device='cpu' (backend='gloo'), or leave device=None")
    if existing is not None:
        staged = existing == "gloo" and (kind == "cuda" or backend == STAGED_BACKEND)
        backend = STAGED_BACKEND if staged else existing
    elif backend == "gloo" and kind == "cuda":
        backend = STAGED_BACKEND
    else:
        backend = choose_backend(backend if backend is not None or kind != "cpu" else "gloo")
    if "nccl" in backend and kind == "cpu":
        raise ValueError(f"backend={backend!r} moves CUDA tensors only, so device='cpu' cannot go with it; use "
                         "backend='gloo' for CPU ranks, or device='cuda'")
    if backend == STAGED_BACKEND:
        STAGED.register()
    return backend, choose_device(backend, local_rank, kind)


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
    # NOTE: CPU device_id is rejected by torch 2.13; a staged gloo group binds no device (it is not a NCCL communicator)
    device_id = device if device.type == "cuda" and backend != STAGED_BACKEND else None
    if info.world_size == 1 and info.master_addr is None:
        # A world of one needs no rendezvous: an in-process store avoids binding a port.
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, device_id=device_id)
        return
    store = restart_store(timeout)  # torchrun: this restart's keys (its shared store outlives a restart)
    dist.init_process_group(
        backend, init_method=None if store else f"tcp://{info.master_addr}:{info.master_port}", store=store,
        rank=info.rank, world_size=info.world_size, timeout=timeout, device_id=device_id)
