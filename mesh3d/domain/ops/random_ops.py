"""Dropout on domain tensors in training mode: the one-process mask, this rank's rows of it.

Usage: automatic, after ``DistributedManager.manual_seed(seed)`` (every rank of a sample's domain group then
shares one random stream)::

    dm.manual_seed(0)
    y = F.dropout(xs, p=0.1, training=True)   # the mask F.dropout(x) draws in one process, rows of this rank

Every domain rank draws the mask of the whole tensor (the same numbers, in the same order, as the one-process
call) and keeps its own rows (slabs), its block (blocks) or its tokens (token grids), so the generator stays in step
across the domain and the result is exact.
NOTE: drawing the whole mask costs O(global) transient memory and time on every rank; an offset-based draw
of this rank's rows only (DTensor's RNG tracker) needs the CUDA Philox generator and is not implemented.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d.domain.core.specs import BlockSpec, TokenSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, local_shape, size_of, unwrap
from mesh3d.domain.dispatch.registry import BLOCK_RULES, TOKEN_RULES, op_name, register
from mesh3d.domain.dispatch.step import Step

__all__ = ["dropout_mask", "own_part"]


def dropout_mask(func, whole: torch.Size, like: torch.Tensor, p: float) -> torch.Tensor:
    """The scaled keep-mask ``func`` (``F.dropout``, ``dropout2d`` ...) draws for a tensor of shape ``whole``: the same
    shape, dtype and device as the one-process call, so the same numbers from the same generator state.

    Usage: ``mask = dropout_mask(F.dropout, xs.shape, local, 0.1)``
    """
    with torch.no_grad():
        return func(torch.ones(whole, dtype=like.dtype, device=like.device), p, True)


def own_part(part: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This rank's ``part`` of the whole ``mask``, in memory of its own where it is less than all of it.

    Usage: ``local * own_part(mask.narrow(dim, offset, rows), mask)``

    NOTE: the product saves its mask for backward; a narrowed view kept the whole tensor's mask alive on every rank
    until then (measured: a dropout at D=2 saved the whole field's bytes per rank), O(global) activation memory per
    dropout where the draw is meant to be transient."""
    return part.clone() if part.numel() < mask.numel() else part


def _dropout_rule(func):
    def rule(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        if not isinstance(input, DomainTensor) or input.spec.dim is None:
            raise NotImplementedError(f"{op_name(func)}: dropout of a plain tensor by a domain-sharded p is not supported")
        spec, whole = input.spec, size_of(input)
        offset, rows = spec.offset, spec.sizes[spec.comm.index]

        def compute(local):
            mask = dropout_mask(func, whole, local, p)
            return local * own_part(mask.narrow(spec.dim, offset, rows), mask)

        return Step(compute, (input,), out=spec)

    return rule


def _grid_dropout_rule(func):
    """Blocks and token grids: the whole mask, then this rank's block (a narrow per block dim) or its tokens (its
    global token indices)."""
    def rule(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        spec = input._spec
        if isinstance(spec, TokenSpec) and spec.keys is not None:
            raise NotImplementedError(f"{op_name(func)} on attention scores of a token grid is not supported; use "
                                      "p=0, or F.scaled_dot_product_attention without dropout")
        local = unwrap(input)
        mask = dropout_mask(func, spec.global_shape(local_shape(input)), local, p)
        if isinstance(spec, BlockSpec):
            part = mask
            for dim, offset, rows in zip(spec.dims, spec.offsets, spec.local_sizes):
                part = part.narrow(dim, offset, rows)
            mask = own_part(part, mask)
        else:
            mask = mask.index_select(spec.token_dim, spec.global_index.to(mask.device))
        if inplace:
            local.mul_(mask)
            return input
        return adopt(local * mask, spec)

    return rule


for _f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d):
    register(_f)(_dropout_rule(_f))
    BLOCK_RULES.register(_f, _grid_dropout_rule(_f))
    TOKEN_RULES.register(_f, _grid_dropout_rule(_f))


def _alpha_dropout(input, p=0.5, training=False, inplace=False):
    if not training or p == 0:
        return input
    raise NotImplementedError(
        "F.alpha_dropout in training mode on a domain tensor is not supported (its noise is not a multiplicative "
        "mask); use F.dropout, p=0, or apply it after .full_tensor()")


for _f in (F.alpha_dropout, F.feature_alpha_dropout):
    register(_f)(_alpha_dropout)
    BLOCK_RULES.register(_f, _alpha_dropout)
    TOKEN_RULES.register(_f, _alpha_dropout)
