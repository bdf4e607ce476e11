"""Indexing along a dim that is not sharded: ``torch.gather`` and ``torch.take_along_dim`` on slabs.

Usage: on a domain tensor ``scores.gather(1, labels.unsqueeze(1))`` (a class's score per pixel) or
``torch.take_along_dim(x, idx, dim=1)`` give the one-process values, with ``labels``/``idx`` sharded like ``x``.

Each rank gathers within its own rows: along a dim that is not sharded the index picks from the same rows it sits in,
so nothing moves. Along the sharded dim the index would be global (another rank's rows): refused by name.
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.registry import op_name, register
from mesh3d.domain.dispatch.step import Step

__all__: list[str] = []


def _aligned(func, input, index, dim: int) -> int:
    """The dim, once the index is checked to be laid out like the input along a dim that is not sharded."""
    d = dim % input.ndim
    if not isinstance(index, DomainTensor) or not isinstance(input, DomainTensor):
        raise NotImplementedError(f"{op_name(func)}: shard the index like the input (domain.shard(index, dim="
                                  f"{input.spec.dim if isinstance(input, DomainTensor) else '...'})), or call "
                                  ".full_tensor() on the input first")
    if d == input.spec.dim:
        raise NotImplementedError(f"{op_name(func)} along the sharded dim {d}: its indices are global positions "
                                  "(other ranks' rows); call .full_tensor() first")
    if index.ndim != input.ndim or index.spec.dim != input.spec.dim or index.spec.sizes != input.spec.sizes:
        raise ValueError(f"{op_name(func)}: the index must be sharded like the input (dim {input.spec.dim}, sizes "
                         f"{input.spec.sizes}); it is sharded along dim {index.spec.dim} with sizes {index.spec.sizes}")
    return d


@register(torch.gather, torch.Tensor.gather)
def _gather(input, dim, index, *, sparse_grad=False, out=None):
    if out is not None:
        raise NotImplementedError("torch.gather(out=...) on a domain tensor: assign the result instead")
    d = _aligned(torch.gather, input, index, dim)
    return Step(lambda t, i: torch.gather(t, d, i, sparse_grad=sparse_grad), (input, index), out=index.spec)


@register(torch.take_along_dim, torch.Tensor.take_along_dim)
def _take_along_dim(input, indices, dim=None, *, out=None):
    if out is not None or dim is None:
        raise NotImplementedError("torch.take_along_dim on a domain tensor needs dim= (without it the indices are "
                                  "flat global positions) and no out=")
    d = _aligned(torch.take_along_dim, input, indices, dim)
    return Step(lambda t, i: torch.take_along_dim(t, i, d), (input, indices), out=indices.spec)
