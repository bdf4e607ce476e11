"""The mean and variance over the whole domain from one exchange, for the norms and for ``var``/``std`` over sharded
dims: each rank's count, mean and sum of squared deviations (one pass, ``torch.var_mean``), merged in rank order as
Chan, Golub and LeVeque's parallel variance does, in float64. As stable as two passes (a global mean, then the squared
deviations from it), the same bits on every rank, and one round trip between the ranks where two passes took two.

Usage (``combine``: a ``step.Combining``'s, which the executor hands a step)::

    mean, spread = merged_moments(local, [2, 3], combine)          # float64, keepdim; spread: sum of (x - mean)^2
    v = variance(local, [2, 3], count, correction=1, combine=combine)   # replicated, differentiable
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["merged_moments", "variance"]


def merged_moments(local: torch.Tensor, dims: list[int], combine: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, sum of squared deviations) over ``dims`` (non-negative) of the whole domain, keepdim, in float64; no
    gradient (for an autograd Function's forward)."""
    n = math.prod(local.shape[d] for d in dims)
    stats = [1 if d in dims else s for d, s in enumerate(local.shape)]
    if n:
        var, mean = torch.var_mean(local, dims, correction=0, keepdim=True)
        mine = torch.stack([mean.new_full(stats, n, dtype=torch.float64), mean.double(), var.double() * n])
    else:  # NOTE: an empty shard: its mean is 0/0; it adds nothing
        mine = local.new_zeros((3, *stats), dtype=torch.float64)
    counts, means, spreads = combine(mine, how="parts", grad=False).unbind(1)
    mean = (counts * means).sum(0) / counts.sum(0)
    return mean, spreads.sum(0) + (counts * (means - mean).square()).sum(0)


class _Variance(torch.autograd.Function):
    """``var`` over ``dims`` of the whole domain (keepdim), replicated. Backward needs no exchange: each rank's shard
    gets the replicated gradient times 2 (x - mean) / (count - correction), the one-process formula on its rows."""

    @staticmethod
    def forward(local, dims, count, correction, combine):
        mean, spread = merged_moments(local, dims, combine)
        return (spread / max(count - correction, 0)).to(local.dtype), mean.to(local.dtype)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # NOTE: the form torch.func's transforms run
        local, ctx.dims, ctx.count, correction, ctx.combine = inputs
        ctx.denominator = max(ctx.count - correction, 0)
        ctx.save_for_backward(local, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, _grad_mean):
        local, mean = ctx.saved_tensors
        if torch.is_grad_enabled():
            # NOTE: create_graph=True (second derivatives): the mean recorded from the shards, so its own gradient
            # (1 / count per element) is in the graph; the replicated gradient enters each shard, so the gradients
            # of its uses are summed over the domain on the way back
            mean = ctx.combine(local.sum(ctx.dims, keepdim=True), for_shards=True) / ctx.count
            grad = ctx.combine(grad, how="enter")
        return grad * 2 * (local - mean) / ctx.denominator, None, None, None, None


def variance(local: torch.Tensor, dims: list[int], count: int, correction: float, combine: Callable) -> torch.Tensor:
    """``local``'s part of the variance over ``dims`` (non-negative) of the whole domain, ``count`` elements in all,
    keepdim: the same replicated value on every rank, differentiable to any order.

    Usage: ``Step(lambda t, combine: variance(t, [2, 3], n, 1, combine), (xs, Combining(comm)), out=replicated)``
    """
    return _Variance.apply(local, dims, count, correction, combine)[0]
