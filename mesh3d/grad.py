"""Gradient utilities that stay correct over a mix of DTensors on different meshes and plain tensors.

Usage::

    loss = global_mean_loss(per_sample_losses.sum(), count=len(per_sample_losses))
    loss.backward()
    total_norm = mesh3d.clip_grad_norm_(model.parameters(), max_norm=1.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from mesh3d.manager import DistributedManager

__all__ = ["clip_grad_norm_", "global_mean_loss", "grad_norm"]


def _local_and_dims(grad: torch.Tensor) -> tuple[torch.Tensor, DeviceMesh | None, tuple[int, ...]]:
    """This rank's piece of ``grad`` and the mesh dims over which pieces differ (must be summed)."""
    if not isinstance(grad, DTensor):
        return grad, None, ()
    if any(isinstance(p, Partial) for p in grad.placements):
        # A pending reduction: settle it so every piece holds final values.
        placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        grad = grad.redistribute(grad.device_mesh, placements)
    # Replicate dims hold copies: summing over them would count a piece more than once.
    dims = tuple(i for i, p in enumerate(grad.placements) if not isinstance(p, Replicate))
    return grad.to_local(), grad.device_mesh, dims


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, as the unsharded model would compute it (a plain tensor).

    Usage: ``norm = mesh3d.grad_norm(model.parameters())``

    Each DTensor contributes its local piece once per distinct piece: its per-group partial
    sums are all-reduced over the mesh dims where it is sharded, never over the dims where it
    is replicated. Plain tensors are taken to be the same on every rank. Every rank must call
    this with the same parameters in the same order (it is collective).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    # One accumulator per (mesh, sharded dims): one all-reduce per group instead of per tensor.
    buckets: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]] = {}
    for grad in grads:
        local, mesh, dims = _local_and_dims(grad)
        local = local.detach().to(torch.float64 if local.dtype == torch.float64 else torch.float32)
        if inf:
            value = local.abs().max() if local.numel() else local.new_zeros(())
        else:
            value = local.abs().pow(norm_type).sum()
        buckets.setdefault((mesh, dims), []).append(value)
    device = grads[0].device if grads else torch.device("cpu")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    total = torch.zeros((), device=device, dtype=dtype)
    for (mesh, dims), values in buckets.items():
        part = torch.stack([v.to(dtype) for v in values])
        part = part.max() if inf else part.sum()
        for dim in dims:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = torch.maximum(total, part) if inf else total + part
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before clipping.

    Usage: ``total = mesh3d.clip_grad_norm_(model.parameters(), max_norm=1.0)``

    Like ``torch.nn.utils.clip_grad_norm_``, but for any mix of DTensors on different
    sub-meshes (TP, FSDP, FSDP+TP) and plain tensors, where torch's raises
    "mixed torch.Tensor and DTensor" or counts replicated pieces several times.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local.mul_(scale.to(device=local.device, dtype=local.dtype))
    return total


def global_mean_loss(loss_sum: torch.Tensor, count: int | float | torch.Tensor, *, axis: str = "batch_domain") -> torch.Tensor:
    """``loss_sum`` divided by the GLOBAL count, scaled so that mesh3d's gradient average gives the global mean.

    Usage: ``loss = mesh3d.global_mean_loss(F.cross_entropy(logits, y, reduction="sum"), y.numel())``

    ``loss_sum`` is this rank's sum of per-sample (or per-token) losses and ``count`` how many
    it summed. Ranks may hold different counts. The counts are summed over ``axis`` (default
    ``"batch_domain"``: domain ranks hold different tokens/points of the same samples; use
    ``"batch"`` when every domain rank counts the same samples). Gradients are averaged over
    the batch axis by ``parallelize``, hence the factor ``batch``. The return value is this
    rank's share; to log the global mean, all-reduce its detached value over ``batch_domain``
    and divide by ``batch``.
    """
    dm = DistributedManager()
    total = torch.as_tensor(count, dtype=torch.float64, device=dm.device).clone()
    dist.all_reduce(total, group=dm.group(axis))
    if total.item() <= 0:
        raise ValueError(f"global_mean_loss: the global count over {axis!r} is {total.item()}; it must be positive")
    return loss_sum * (dm.axis_size("batch") / total.to(loss_sum.dtype))
