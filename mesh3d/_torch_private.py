"""Every private PyTorch API that mesh3d relies on, in one place.

Each function says which private name it touches and why no public API serves.
If a torch upgrade breaks mesh3d, this is the first file to look at.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_mesh", "group_options", "local_shape_and_global_offset"]


def group_options(backend: str, timeout: timedelta) -> object | None:
    """Process-group options that carry ``timeout`` for ``backend``, or None if unknown.

    Why private: ``init_device_mesh`` has no ``timeout`` argument in torch 2.13, and the
    sub-groups it creates fall back to the backend's default (30 minutes for gloo), not to
    the default group's timeout. Its ``backend_override`` accepts options objects, whose
    ``_timeout`` field it forwards to ``new_group``; that field is private.
    """
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


def flatten_mesh(mesh: DeviceMesh, name: str, backend_override: object | None = None) -> DeviceMesh:
    """A 1-D mesh over all ranks of ``mesh``, registered under ``name`` on its root mesh.

    Why private: ``DeviceMesh._flatten`` is the only way to get a flattened mesh that
    shares its root with the 3-D mesh; FSDP2 and DTensor redistribution need that shared
    root to compose with tensor parallelism (a mesh built separately from the same ranks
    would be a different, incompatible mesh).
    """
    if backend_override is None:
        return mesh._flatten(name)
    return mesh._flatten(name, backend_override=backend_override)


def local_shape_and_global_offset(
    global_shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[object, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (shape, global offset) of this rank's local block of a DTensor.

    Why private: torch has no public API that maps (global shape, mesh, placements) to
    the box a rank holds, and the rules for uneven shards and ``_StridedShard`` (FSDP2
    over TP) are subtle enough that re-deriving them invites the offset bugs DCP had.
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` is what
    DTensor itself and DCP's planner use. The checkpointer double-checks its answer
    against the local tensor's shape on every save and load.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offset)
