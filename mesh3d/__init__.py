"""mesh3d: 3D-parallel training for PyTorch on one named (batch, domain, model) mesh.

Usage::

    from mesh3d import DistributedManager
    dm = DistributedManager.initialize(batch=-1, domain=2, model=2)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from mesh3d import checkpoint, domain, planner
    from mesh3d.faults import PEER_LOST_EXIT_CODE, CollectiveTimeoutError, PeerLostError, WatchSettings
    from mesh3d.grad import clip_grad_norm_, global_mean_loss, grad_norm
    from mesh3d.launcher import LaunchInfo, detect_launcher
    from mesh3d.log import get_logger
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

#: Every public name and the module it comes from, loaded on first use. NOTE: ``import mesh3d`` imports nothing
#: else, so ``mesh3d --version`` and ``--help`` answer without torch (2 s); ``from mesh3d import DistributedManager``
#: loads the manager then, and neither it nor ``mesh3d.domain`` loads torch's compiler stack or DTensor (2.5 s more:
#: ``mesh3d._torch_private.compile`` says how). The subpackages load on first use too (``mesh3d.checkpoint.save`` works after ``import mesh3d``).
_LAZY = {
    "AXES": "mesh3d.mesh_shape", "resolve_mesh_shape": "mesh3d.mesh_shape",
    "CollectiveTimeoutError": "mesh3d.faults", "PEER_LOST_EXIT_CODE": "mesh3d.faults", "PeerLostError": "mesh3d.faults",
    "WatchSettings": "mesh3d.faults",
    "DistributedManager": "mesh3d.manager",
    "LaunchInfo": "mesh3d.launcher", "detect_launcher": "mesh3d.launcher",
    "PREEMPTED_EXIT_CODE": "mesh3d.preempt",
    "Plan": "mesh3d.parallel", "parallelize": "mesh3d.parallel",
    "clip_grad_norm_": "mesh3d.grad", "global_mean_loss": "mesh3d.grad", "grad_norm": "mesh3d.grad",
    "get_logger": "mesh3d.log",
}
_LAZY_SUBPACKAGES = ("checkpoint", "domain", "planner")

#: Functions opt_einsum looks up by a domain tensor's module (``mesh3d.domain.array_backend`` says why).
_ARRAY_BACKEND = ("einsum", "tensordot", "transpose")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups find it directly
        return value
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"mesh3d.{name}")
    if name in _ARRAY_BACKEND:
        return getattr(importlib.import_module("mesh3d.domain.array_backend"), name)
    raise AttributeError(f"module 'mesh3d' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
