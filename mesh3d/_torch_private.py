"""Every private PyTorch API that mesh3d relies on, in one place.

Each function says which private name it touches and why no public API serves.
If a torch upgrade breaks mesh3d, this is the first file to look at.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["clear_dtensor_caches", "flatten_mesh", "group_options", "local_shape_and_global_offset"]


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


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached redistribution plans (call after destroying a mesh's groups).

    Why private: ``torch.distributed.tensor._redistribute._gen_transform_infos`` is an
    unbounded ``functools.cache`` keyed by DTensorSpec, and DeviceMesh equality ignores
    process groups. After ``DistributedManager.shutdown()`` and a new ``initialize`` in the
    same process, an equal-looking new mesh hits a cached plan that still names the old,
    destroyed group: "Could not resolve the process group registered under the name 6".
    The sharding propagator's caches hold output specs with the old mesh object too.
    """
    from torch.distributed.tensor import DTensor, _redistribute

    _redistribute._gen_transform_infos.cache_clear()
    # Sharding propagation caches output specs, which hold the (old) mesh object itself.
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        fn = getattr(propagator, name, None)
        cache = getattr(fn, "cache", fn)
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    # The C++ dispatch fast path keeps its own sharding cache (torch 2.13); this is the culprit
    # for FSDP2 parameters (nn.Parameter(dtensor) detaches through it).
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
