"""mesh3d: 3D-parallel training for PyTorch on one named (batch, domain, model) mesh.

Usage::

    from mesh3d import DistributedManager
    dm = DistributedManager.initialize(batch=-1, domain=2, model=2)
"""

import importlib
from types import ModuleType

from mesh3d.grad import clip_grad_norm_, global_mean_loss, grad_norm
from mesh3d.launcher import LaunchInfo, detect_launcher
from mesh3d.log import get_logger
from mesh3d.faults import PEER_LOST_EXIT_CODE, CollectiveTimeoutError, PeerLostError, WatchSettings
from mesh3d.manager import DistributedManager
from mesh3d.mesh_shape import AXES, resolve_mesh_shape
from mesh3d.parallel import Plan, parallelize
from mesh3d.preempt import PREEMPTED_EXIT_CODE

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "CollectiveTimeoutError",
    "DistributedManager",
    "LaunchInfo",
    "PEER_LOST_EXIT_CODE",
    "PeerLostError",
    "PREEMPTED_EXIT_CODE",
    "Plan",
    "WatchSettings",
    "__version__",
    "checkpoint",
    "clip_grad_norm_",
    "detect_launcher",
    "domain",
    "get_logger",
    "global_mean_loss",
    "grad_norm",
    "parallelize",
    "planner",
    "resolve_mesh_shape",
]

#: Subpackages loaded on first use: ``import mesh3d`` stays cheap (the checkpointer pulls in
#: torch.distributed.checkpoint's state-dict helpers), yet ``mesh3d.checkpoint.save`` works.
_LAZY_SUBPACKAGES = ("checkpoint", "domain", "planner")


#: Functions opt_einsum looks up by a domain tensor's module (``mesh3d.domain.array_backend`` says why).
_ARRAY_BACKEND = ("einsum", "tensordot", "transpose")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"mesh3d.{name}")
    if name in _ARRAY_BACKEND:
        return getattr(importlib.import_module("mesh3d.domain.array_backend"), name)
    raise AttributeError(f"module 'mesh3d' has no attribute {name!r}")
