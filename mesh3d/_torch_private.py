"""Every private PyTorch API that mesh3d relies on, in one place.

Each function says which private name it touches and why no public API serves.
If a torch upgrade breaks mesh3d, this is the first file to look at.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["disable_torch_function_subclass", "flatten_mesh", "group_options"]


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


def disable_torch_function_subclass():
    """Context manager under which tensor subclasses' ``__torch_function__`` is not called.

    Why private: ``torch._C.DisableTorchFunctionSubclass`` is what ``Tensor.__torch_function__``
    itself uses to run an op on a subclass's data without recursing; torch exposes no public
    equivalent. mesh3d's ``DomainTensor`` needs it to unwrap its local shard and to run
    metadata queries (``.shape``, ``.dtype``) on it.
    """
    import torch

    return torch._C.DisableTorchFunctionSubclass()
