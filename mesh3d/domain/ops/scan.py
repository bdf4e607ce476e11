"""Scans along a dim: ``torch.cumsum`` and ``torch.cumprod`` (and their tensor methods), the sharded dim included.

Usage: ``torch.cumsum(xs, dim=xs.spec.dim)`` is the one-process prefix sum, sharded like ``xs``.

Along the sharded dim each rank scans its own rows, then adds the total of the ranks before it (multiplies, for
``cumprod``). The totals travel as one all-reduce of a (D, ...) stack holding each rank's last scanned row in its
own slot: no rows move, only D rows of the other dims. Backward runs through that all-reduce
(``reduce_for_local_use``): the gradient of a total that later ranks used comes back to the rank that owns it.
An empty shard's total is the neutral element (0, or 1). Along any other dim the scan is local.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.ops.pointwise import elementwise
from mesh3d.domain.dispatch.registry import op_name, register
from mesh3d.domain.dispatch.step import Combining, Step
from mesh3d.domain.core.tensor import DomainTensor

__all__ = ["sharded_scan"]

_SCANS = {"cumsum": (torch.cumsum, torch.Tensor.cumsum), "cumprod": (torch.cumprod, torch.Tensor.cumprod)}


def sharded_scan(local: torch.Tensor, dim: int, comm: DomainComm, kind: str, combine: Callable) -> torch.Tensor:
    """This rank's rows of the one-process ``cumsum``/``cumprod`` of a tensor sharded along ``dim`` (every rank's last
    row combined by ``combine``, a ``step.Combining``'s).

    Usage: ``Step(lambda t, combine: sharded_scan(t, 2, comm, "cumsum", combine), (xs, Combining(comm)), out=xs.spec)``
    """
    scanned = torch.cumsum(local, dim) if kind == "cumsum" else torch.cumprod(local, dim)
    rows = local.shape[dim]
    if rows:
        last = scanned.narrow(dim, rows - 1, 1)
    else:  # NOTE: the empty sum (product) of the shard itself, so it is in autograd's graph as on the other ranks
        last = scanned.sum(dim, keepdim=True) if kind == "cumsum" else scanned.prod(dim, keepdim=True)
    stack = torch.stack([last if q == comm.index else torch.zeros_like(last) for q in range(comm.size)])
    # NOTE: rank 0 adds the empty sum (multiplies by the empty product) too: every rank must reach the all-reduce's
    # backward, or its peers would wait there for it.
    before = combine(stack, for_shards=True)[: comm.index]
    return scanned + before.sum(0) if kind == "cumsum" else scanned * before.prod(0)


def _scan_rule(func, kind: str):
    def rule(input: DomainTensor, dim: int, *, dtype: torch.dtype | None = None, out=None) -> Step:
        if out is not None:
            raise NotImplementedError(f"{op_name(func)}(out=...) is not supported on a domain tensor; use the result")
        if not isinstance(dim, int) or not -input.ndim <= dim < input.ndim:
            raise IndexError(f"{op_name(func)}: dim={dim!r} is out of range for a {input.ndim}-D tensor")
        if dtype is not None:
            input = elementwise(torch.Tensor.to, input, dtype)
        d = dim % input.ndim
        comm = input.spec.comm
        if d != input.spec.dim or comm.size == 1:
            return Step(lambda t: func(t, d), (input,), out=input.spec)
        return Step(lambda t, combine: sharded_scan(t, d, comm, kind, combine), (input, Combining(comm)), out=input.spec)

    return rule


for _kind, _funcs in _SCANS.items():
    for _func in _funcs:
        register(_func)(_scan_rule(_func, _kind))
