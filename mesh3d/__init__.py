"""mesh3d: 3D-parallel training for PyTorch on one named (batch, domain, model) mesh.

Usage::

    from mesh3d import DistributedManager
    dm = DistributedManager.initialize(batch=-1, domain=2, model=2)
"""

from mesh3d import checkpoint
from mesh3d.launcher import LaunchInfo, detect_launcher
from mesh3d.log import get_logger
from mesh3d.manager import DistributedManager
from mesh3d.mesh_shape import AXES, resolve_mesh_shape

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "DistributedManager",
    "LaunchInfo",
    "__version__",
    "checkpoint",
    "detect_launcher",
    "get_logger",
    "resolve_mesh_shape",
]
