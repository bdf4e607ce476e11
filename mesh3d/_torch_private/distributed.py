"""Private torch.distributed APIs: process-group options, mesh flattening, DTensor caches, gloo internals.

Each function says which private name it touches and why no public API serves.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "clear_dtensor_caches",
    "default_store",
    "flatten_mesh",
    "gloo_backend",
    "group_options",
    "live_process_groups",
    "local_shape_and_global_offset",
    "post_barrier",
    "python_group_private_names",
    "unflatten_mesh",
    "wait_async_collective",
]


def group_options(backend: str, timeout: timedelta) -> object | None:
    """Process-group options that carry ``timeout`` for ``backend``, or None if unknown.

    Why private: ``init_device_mesh`` has no ``timeout`` argument in torch 2.13, and the
    sub-groups it creates fall back to the backend's default (30 minutes for gloo), not to
    the default group's timeout. Its ``backend_override`` accepts options objects, whose
    ``_timeout`` field it forwards to ``new_group``; that field is private.
    """
    if backend in ("gloo", "gloo_staged"):  # gloo_staged wraps gloo (mesh3d/staged_gloo)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, see above
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


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...], backend_override: object | None = None) -> DeviceMesh:
    """Split 1-D ``mesh`` into a mesh of shape ``sizes`` named ``names``, sharing its root.

    Why private: HSDP needs a 2-D (replicate, shard) mesh over the batch×domain ranks that
    shares its root with the 3-D mesh (so it composes with tensor parallelism). Slicing the
    root can only give the existing axes; ``DeviceMesh._unflatten`` is the only way to split
    one axis into two with any split the user picks.
    """
    if backend_override is None:
        return mesh._unflatten(0, sizes, names)
    return mesh._unflatten(0, sizes, names, backend_override={name: backend_override for name in names})


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
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415 (deferred)

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offset)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans.

    Why private: ``DeviceMesh.__eq__`` compares ranks, layout and names but not process
    groups, and DTensor caches (sharding propagation ``lru_cache``s, the redistribute plan
    cache, the C++ dispatch fast path) return results that hold the FIRST equal mesh they
    saw. After ``DistributedManager.shutdown()`` and a new mesh of the same shape, those results
    point at destroyed groups ("Could not resolve the process group registered under the
    name 9"). No public API clears them.

    NOTE: DTensor (0.8 s to import) is loaded by whatever made one (FSDP2, tensor parallelism, the checkpointer): where
    it is not loaded, nothing was cached.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _redistribute  # noqa: PLC0415 (deferred)

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        fn = getattr(propagator, name, None)
        cache = getattr(fn, "cache", fn)
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    for name in ("_gen_transform_infos",):
        fn = getattr(_redistribute, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    planner_cache = getattr(_redistribute, "_planner_cache", None)
    if planner_cache is not None:
        planner_cache.clear()
    # The C++ fast path keeps its own sharding cache (this is the one that bites first:
    # nn.Parameter(dtensor) inside fully_shard goes through it).
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


def wait_async_collective(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for ``t``, waiting first if it is a functional collective's lazy result.

    Why private: tensor-parallel styles return ``AsyncCollectiveTensor`` (from
    ``torch.distributed._functional_collectives``) whose all-reduce has not been waited on; it
    cannot be turned into another tensor subclass. A non-view op on it waits and returns a plain
    tensor with the autograd history kept (view ops stay lazy and return another one), so this
    costs one copy of the module's output.
    """
    if type(t).__name__ == "AsyncCollectiveTensor":
        return t.clone()
    return t


def live_process_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank belongs to, oldest first (empty when torch.distributed is not initialized).

    Why private: torch keeps the registry of live groups in ``distributed_c10d._world.pg_names`` and
    exposes no public list; teardown at exit must drain every group, including those torch's own
    libraries or the user made.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    return list(dist.distributed_c10d._world.pg_names)


def gloo_backend(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The gloo backend object behind ``group`` (its CPU backend), or None when it has none.

    Why private: ``ProcessGroup._get_backend`` is the only way to reach a group's backend; mesh3d posts a
    barrier on it directly so the barrier can carry its own timeout (``BarrierOptions.timeout``) and goes
    to gloo even when the group's default device is CUDA.
    """
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    gloo = getattr(dist, "ProcessGroupGloo", None)
    return backend if gloo is not None and isinstance(backend, gloo) else None


def post_barrier(backend: dist.ProcessGroup, timeout: timedelta) -> dist.Work:
    """Post a barrier on a backend object (from ``gloo_backend``) that fails after ``timeout``; returns its work.

    Why here: it goes with ``gloo_backend`` (a backend object is only reachable privately).
    """
    options = dist.BarrierOptions()
    options.timeout = timeout
    return backend.barrier(options)


def default_store() -> dist.Store | None:
    """The store the default process group rendezvoused through (torchrun's, SLURM's or our own), or None.

    NOTE: private (``distributed_c10d._get_default_store``). The peer watch (mesh3d/faults/watch.py) writes its
    heartbeats there: it is the one channel every rank already has that does not go through the (possibly
    stuck) process groups, and under torchrun its server lives in the agent, so it outlives any worker.
    """
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def python_group_private_names(cls: type) -> None:
    """Give a Python ``ProcessGroup`` subclass (mesh3d/staged_gloo) the private method names torch calls on groups.

    Why private: torch 2.11 (a GPU image's) calls ``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base`` and
    the ``*_tensor_coalesced`` names, 2.13 the public ones; FSDP2's allocator and mesh3d's teardown reach a group's
    transport through ``group._get_backend(device)``.
    """
    for private, public in (("_allgather_base", "all_gather_single"), ("_reduce_scatter_base", "reduce_scatter_single"),
                            ("allgather_into_tensor_coalesced", "all_gather_single_coalesced"),
                            ("_get_backend", "backend_for"), ("alltoall_base", "all_to_all_single"),
                            ("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")):
        setattr(cls, private, getattr(cls, public))
