"""Every private PyTorch API that mesh3d relies on, in one place.

Each function says which private name it touches and why no public API serves.
If a torch upgrade breaks mesh3d, this is the first file to look at.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["checkpoint_module", "clear_dtensor_caches", "flatten_mesh", "group_options", "unflatten_mesh"]


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


def checkpoint_module(module: object) -> None:
    """Activation checkpointing on ``module`` without changing its parameter names.

    Why private: ``torch.distributed._composable.checkpoint`` is the only activation
    checkpointing API that keeps fully-qualified names (``checkpoint_wrapper`` inserts
    ``_checkpoint_wrapped_module.`` into every name, which breaks checkpoints keyed by name)
    and composes with ``fully_shard``.
    """
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribute planners.

    Why private: ``DeviceMesh.__eq__`` compares ranks, layout and names but not process
    groups, and DTensor caches (sharding propagation ``lru_cache``s, the redistribute planner
    cache keyed by ``weakref.ref(mesh)``) return results that hold the FIRST equal mesh they
    saw. After ``DistributedManager.shutdown()`` and a new mesh of the same shape, those results
    point at destroyed groups ("Could not resolve the process group registered under the
    name 9"). No public API clears them.
    """
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    cached_meta = getattr(type(propagator), "_propagate_tensor_meta_cached", None)
    if cached_meta is not None and hasattr(cached_meta, "cache_clear"):
        cached_meta.cache_clear()
    _redistribute._planner_cache.clear()
    # The C++ fast path keeps its own sharding cache (this is the one that bites first:
    # nn.Parameter(dtensor) inside fully_shard goes through it).
    clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cpp is not None:
        clear_cpp()
