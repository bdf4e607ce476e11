"""Differentiable all-reduces over the domain group, with the gradient conventions mesh3d uses.

Usage::

    total = reduce_to_replicated(local_sum, comm)     # a loss/reduction result: backward is identity
    stats = reduce_for_local_use(local_sum, comm)     # norm statistics used by every shard: backward sums

The convention (shared with ``parallelize``): a value *replicated* over the domain carries a
replicated gradient (every rank holds the whole gradient), so a replicated loss is backpropagated
with 1 on every rank, and a reduction's backward passes that gradient straight to the local
shard (no factor of the domain size). Parameters are plain tensors used on every shard, so each
rank's backward gives only its shard's partial gradient, and summing parameter gradients over the
domain gives the one-process gradient. A replicated value that is consumed *by the shards* (norm
statistics, or a reduction result multiplied into a domain tensor) gets partial gradients from each
shard, so on its way back it is summed over the domain (``reduce_for_local_use``/``sum_grad``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import exchange_all
from mesh3d.domain.core.linear import linear_op

__all__ = ["sum_dtype", "all_parts", "all_reduce_max", "all_reduce_sum", "reduce_for_local_use",
           "reduce_to_replicated", "sum_grad"]

#: Half-precision dtypes whose partial sums are kept in float32 until the last rounding.
_HALF = (torch.bfloat16, torch.float16)


def sum_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a partial sum of a ``dtype`` shard is kept in: float32 for bf16/fp16 (what torch's kernels accumulate
    in), else None (torch's default).

    Usage: ``part = local.sum(dims, dtype=sum_dtype(local.dtype))``; round to ``local.dtype`` once, after the
    all-reduce (attention's kernels accumulate alike: ``attention_kernel.accumulation_dtype``).
    NOTE: a partial sum rounded to bf16 on each rank, then added in bf16, rounds D + 1 times where one process rounds
    once: GroupNorm at D=2 came out 3.5x farther from fp64 than the one-process bf16 op.
    """
    return torch.float32 if dtype in _HALF else None


def _all_reduce(t: torch.Tensor, comm: DomainComm, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Every rank's ``t`` combined in rank order (the same bits on every rank), over checked p2p messages."""
    if comm.size == 1:
        return t.detach().clone()
    parts = exchange_all(t, comm)
    out = parts[0].clone()
    for part in parts[1:]:
        if op == dist.ReduceOp.MAX:
            torch.maximum(out, part, out=out)
        else:
            out.add_(part)
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def reduce_to_replicated(t: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Sum of every rank's ``t``; backward hands the (replicated) gradient to each rank unchanged."""
    if comm.size == 1:  # nothing to add: no copy, no autograd node
        return t
    # NOTE: the replicated gradient enters every shard: recorded with create_graph=True, its own gradient is the
    # sum over the domain (second derivatives through reductions and losses).
    return linear_op(lambda x: _all_reduce(x, comm), _same, t)


def reduce_for_local_use(t: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Sum of every rank's ``t`` for use by every shard; backward sums the shards' partial gradients."""
    if comm.size == 1:
        return t
    return linear_op(lambda x: _all_reduce(x, comm), lambda g: _all_reduce(g, comm), t)  # the sum is self-adjoint


def sum_grad(t: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Identity whose backward sums gradients over the domain (a replicated value entering the shards)."""
    if comm.size == 1:
        return t
    return linear_op(_same, lambda g: _all_reduce(g, comm), t)


def all_reduce_sum(t: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Element-wise sum over the domain in rank order (not differentiable by itself: for autograd functions' use)."""
    return _all_reduce(t, comm)


def all_parts(t: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Every domain rank's ``t`` (one shape everywhere), stacked in rank order: the same bits on every rank, for a
    combination a sum cannot express (a variance's parts). Not differentiable by itself."""
    return torch.stack(exchange_all(t, comm))


def all_reduce_max(t: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Element-wise max over the domain (not differentiable by itself; used to pick winners)."""
    return _all_reduce(t, comm, dist.ReduceOp.MAX)


def scale_grad(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity whose backward multiplies the gradient by ``factor``.

    Used where a parameter meets a *replicated* value (e.g. a classifier head after global pooling):
    every domain rank computes the same thing, so each contributes 1/D of the parameter's gradient
    and the domain sum of parameter gradients is the one-process gradient.
    """
    scaled = lambda g: g * factor  # noqa: E731 - its own adjoint: the gradient's gradient is scaled too
    return linear_op(_same, scaled, t, again=scaled)
