"""Truth tests and NaN-aware reductions over domain tensors: ``any``, ``all``, ``count_nonzero``, ``allclose``,
``equal``, ``nansum``, ``nanmean``.

Usage: on a domain tensor ``(xs > 2).any()``, ``torch.count_nonzero(mask, dim=2)``, ``torch.allclose(ys, zs)``,
``torch.equal(ys, zs)`` and ``torch.nansum(xs)`` give the one-process answer on every rank (``allclose`` and
``equal`` a Python bool, as torch).

Each is a count or a sum of the element-wise test (``composite.call``: one all-reduce where a sharded dim is reduced),
so every layout whose sums are ruled answers, and no rank decides alone.
"""

from __future__ import annotations

import torch

from mesh3d._torch_private import TRUTH_REDUCTIONS
from mesh3d.domain.core.tensor import DomainTensor, size_of
from mesh3d.domain.ops.composite import call, count_true, register_composite

__all__: list[str] = []


@register_composite(torch.any, torch.Tensor.any, TRUTH_REDUCTIONS[1])
def _any(input, dim=None, keepdim=False, *, out=None):
    if out is not None:
        raise NotImplementedError("torch.any(out=...) on a domain tensor: assign the result instead")
    return call(torch.gt, count_true(call(torch.ne, input, 0), dim, keepdim), 0)


@register_composite(torch.all, torch.Tensor.all, TRUTH_REDUCTIONS[0])
def _all(input, dim=None, keepdim=False, *, out=None):
    if out is not None:
        raise NotImplementedError("torch.all(out=...) on a domain tensor: assign the result instead")
    return call(torch.eq, count_true(call(torch.eq, input, 0), dim, keepdim), 0)


@register_composite(torch.count_nonzero, torch.Tensor.count_nonzero)
def _count_nonzero(input, dim=None):
    return count_true(call(torch.ne, input, 0), dim)


@register_composite(torch.allclose, torch.Tensor.allclose)
def _allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    close = _all(call(torch.isclose, input, other, rtol=rtol, atol=atol, equal_nan=equal_nan))
    return bool(close.to_local() if isinstance(close, DomainTensor) else close)


@register_composite(torch.equal, torch.Tensor.equal)
def _equal(input, other) -> bool:
    """The same (whole) sizes and every element equal, NaN unequal to itself, dtypes promoted: torch's answer."""
    if tuple(size_of(input)) != tuple(size_of(other)):  # NOTE: the same on every rank: no rank waits alone
        return False
    same = _all(call(torch.eq, input, other))
    return bool(same.to_local() if isinstance(same, DomainTensor) else same)


def _zero_nans(input):
    return call(torch.where, call(torch.isnan, input), 0, input)


@register_composite(torch.nansum, torch.Tensor.nansum)
def _nansum(input, dim=None, keepdim=False, *, dtype=None):
    input = input if dtype is None else call(torch.Tensor.to, input, dtype)
    return call(torch.sum, _zero_nans(input)) if dim is None else call(torch.sum, _zero_nans(input), dim, keepdim)


@register_composite(torch.nanmean, torch.Tensor.nanmean)
def _nanmean(input, dim=None, keepdim=False, *, dtype=None):
    """``nansum / count of the non-NaN``, as torch divides (an all-NaN slice gives NaN)."""
    kept = count_true(call(torch.logical_not, call(torch.isnan, input)), dim, keepdim)
    return call(torch.div, _nansum(input, dim, keepdim, dtype=dtype), kept)
