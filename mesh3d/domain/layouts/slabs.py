"""Gathering a sharded dim whole onto every rank: ``full_tensor``, and results of global length 1 made replicated.

Usage::

    whole = full_tensor(ys)               # a replicated domain tensor (differentiable)
    y = replicate_if_singleton(y)         # the dispatcher does this for every op result

A result whose sharded dim has global length 1 (``AdaptiveAvgPool2d(1)``, ``x[:, :1]``) lives on one
rank while the others hold empty shards; a classifier head's ``view(B, -1)`` on it cannot work
shard by shard. Such a result is gathered (one row, from its owner) and becomes a *replicated*
value, on which any op runs as is. Backward follows ``full_tensor``: every rank holds the whole
(replicated) gradient and keeps its own slice, so the owner gets it once.
"""

from __future__ import annotations

import torch

from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.comm.rows import Span, plan_exchange
from mesh3d.domain.core.linear import linear_op
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.comm.rows import block_needs

__all__ = ["full_tensor", "replicate_if_singleton", "strided_rows"]


def full_tensor(x: DomainTensor) -> DomainTensor:
    """The whole tensor on every domain rank (differentiable), as a *replicated* domain tensor.

    Usage: ``whole = domain.full_tensor(ys)  # or ys.full_tensor()``

    Replicated, not plain: parameters applied to it afterwards (a head after gathering) then get
    1/D of their gradient on each rank, so the domain sum of gradients stays the one-process one.
    ``.to_local()`` gives the plain tensor.
    """
    if x.spec.dim is None:
        return x
    spec = x.spec
    if spec.outer > 1:  # a strided layout: its blocks split out (an unstrided slab), gathered, merged again
        d, whole = spec.dim, list(x.shape)
        blocks = x.view([*whole[:d], spec.outer, sum(spec.sizes), *whole[d + 1:]])
        return full_tensor(blocks).view(whole)
    # NOTE: planned here, not in the autograd function: Dynamo traces its forward with the spec's ints as symbols
    everything = (Span.rows(0, sum(spec.sizes)),)  # O(D) to plan, whatever the length
    plan = plan_exchange(spec.sizes, (everything,) * len(spec.sizes), spec.comm.index)
    # The whole tensor is replicated, so each rank's gradient is the whole gradient: keep my slice
    whole = linear_op(lambda t: gather_rows(t, spec.dim, plan, spec.comm),
                      lambda g: g.narrow(spec.dim, spec.offset, spec.sizes[spec.comm.index]), unwrap(x))
    return adopt(whole, DomainSpec.replicated(spec.comm))


def replicate_if_singleton(x: DomainTensor) -> DomainTensor:
    """``x`` replicated when its sharded dim has global length 1, else ``x`` (on one rank too: same path at any D).

    Usage: ``pooled = replicate_if_singleton(adopt(local, spec))``
    """
    spec = x._spec
    if spec.dim is None or sum(spec.sizes) != 1:
        return x
    return full_tensor(x)


def redistribute_local(x: DomainTensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``x``'s rows in the layout ``sizes`` (plain local tensor; only rows that change rank travel).

    Usage: ``local = redistribute_local(xs, (4, 4, 2))``
    """
    spec = x._spec
    if tuple(sizes) == spec.sizes:
        return unwrap(x)
    return gather_rows(unwrap(x), spec.dim, plan_exchange(spec.sizes, block_needs(tuple(sizes)), spec.comm.index),
                       spec.comm)


def strided_rows(t: torch.Tensor, dim: int, spec: DomainSpec) -> torch.Tensor:
    """This rank's rows of the plain ``t``, which has the global length of ``spec``'s sharded dim along ``dim``.

    Usage: ``mine = strided_rows(mask, 0, xs.spec)``; with a strided layout (``spec.outer > 1``) its rows of each block.
    """
    n, offset = spec.sizes[spec.comm.index], spec.offset
    if spec.outer == 1:
        return t.narrow(dim, offset, n)
    return t.unflatten(dim, (spec.outer, sum(spec.sizes))).narrow(dim + 1, offset, n).flatten(dim, dim + 1)
