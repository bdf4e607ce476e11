"""Rules for a strided layout (``DomainSpec.outer > 1``): the sharded rows merged under dims before them.

Usage: automatic, through torch::

    h = x.view(-1, x.shape[-1])          # (B, T, C) sharded along T -> (B*T, C): B blocks of this rank's rows
    h = torch.addmm(bias, h, w)          # row-wise: local
    y = h.view(x.shape[0], x.shape[1], -1)   # the blocks split out again: sharded along T as before
    w = x.view(-1, ws * ws, c)           # Swin's windows of B > 1 samples merged into one batch of windows

GPT-2's ``Conv1D`` and Swin's window partition with more than one sample produce it. Only ops that act on each row
by itself (element-wise, row-wise products, attention within a window, norms and softmax over other dims) and
reshapes are exact on it; everything else raises naming the op and the way back (reshape to the unstrided shape).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d._torch_private import linear_not_a_view
from mesh3d.domain.ops import global_index, idioms, pointwise, reshape  # noqa: F401  (their rules registered first)
from mesh3d.domain.ops.attention import sdpa_rule
from mesh3d.domain.layouts.slabs import strided_rows
from mesh3d.domain.ops.matmul import matmul_rule
from mesh3d.domain.ops.random_ops import dropout_mask, own_part
from mesh3d.domain.dispatch.registry import RULES, STRIDED_RULES, op_name
from mesh3d.domain.dispatch.step import Entering, Step
from mesh3d.domain.core.tensor import DomainTensor

__all__ = ["elementwise_rule"]


def elementwise_rule(func):
    """Operands laid out alike (dim from the end, sizes, blocks); plain ones of size 1 or the global length there."""
    def rule(*args, **kwargs):
        pointwise.refuse_other_forms(func, args, kwargs)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        sharded = [t for t in tensors if isinstance(t, DomainTensor) and t.spec.dim is not None]
        ref = sharded[0]
        for t in sharded[1:]:
            if (t.ndim - t.spec.dim, t.spec.sizes, t.spec.outer) != (ref.ndim - ref.spec.dim, ref.spec.sizes,
                                                                       ref.spec.outer):
                raise NotImplementedError(f"{op_name(func)}: strided domain tensors laid out differently; reshape "
                                          "them back to their unstrided shapes first")
        out_ndim = max(t.ndim for t in tensors)
        out_dim = ref.spec.dim + out_ndim - ref.ndim
        length = ref.shape[ref.spec.dim]

        def requirement(o):
            if not isinstance(o, torch.Tensor) or (isinstance(o, DomainTensor) and o.spec.dim is not None):
                return o
            aligned = out_dim - (out_ndim - o.ndim)
            if aligned >= 0 and o.shape[aligned] == length != 1:
                return idioms.replicated_slice(o, aligned, ref)
            if aligned >= 0 and o.shape[aligned] != 1:
                raise ValueError(f"{op_name(func)}: a tensor of shape {tuple(o.shape)} next to a strided domain tensor "
                                 f"of shape {tuple(ref.shape)}: give it size 1 or the global length {length} there")
            return Entering(o) if isinstance(o, DomainTensor) else o

        spec = ref.spec.with_sizes(ref.spec.sizes, dim=out_dim)
        return Step(func, tuple(requirement(a) for a in args), {k: requirement(v) for k, v in kwargs.items()},
                    out=spec, out_ndim=out_ndim, keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))

    return rule


def _rows_local(func):
    """A product acting on each row of the first operand (``addmm``'s ``mat1``, ``F.linear``): local."""
    def rule(*args, **kwargs):
        sharded = [a for a in (*args, *kwargs.values()) if isinstance(a, DomainTensor) and a.spec.dim is not None]
        x = sharded[0]
        if x.spec.dim == x.ndim - 1:
            raise NotImplementedError(f"{op_name(func)} contracts the strided sharded dim; reshape it back first")
        if len(sharded) > 1:
            raise NotImplementedError(f"{op_name(func)} with a domain-sharded weight or bias: the weights must be "
                                      "plain (replicated) tensors; call .full_tensor() on them first")
        return Step(linear_not_a_view if func is F.linear else func, args, kwargs, out=x.spec)  # NOTE: see its docstring

    return rule


def _matmul_of_rows(func):
    """``a @ w`` with ``a`` strided and ``w`` plain or replicated: the slab rule (each row of ``a`` on its own); ``a @ b``
    with both strided alike along a batch dim (MobileViT's attention over patches merged into the batch): each rank's
    batch entries on their own. Any other strided right operand would be gathered in rank order, not the global one:
    refused."""
    slab = matmul_rule(func)

    def rule(input, other, *, out=None):
        if isinstance(other, DomainTensor) and other.spec.dim is not None:
            if (out is None and isinstance(input, DomainTensor) and input.spec == other.spec
                    and input.ndim == other.ndim and input.spec.dim < input.ndim - 2):
                return Step(func, (input, other), out=input.spec)
            raise NotImplementedError(
                f"{op_name(func)} with a strided domain tensor as its right operand: reshape both operands back to "
                "their unstrided shapes first (x.view(B, T, c)), or call .full_tensor()")
        return slab(input, other, out=out)

    return rule


def _local_unless(func, dims_of):
    """A norm or softmax over dims other than the sharded one: local; over it: refused."""
    def rule(input, *args, **kwargs):
        if input.spec.dim in dims_of(input, args, kwargs):
            raise NotImplementedError(f"{op_name(func)} acts along the strided sharded dim {input.spec.dim}; reshape "
                                      "to the unstrided shape first")
        return Step(lambda t: func(t, *args, **kwargs), (input,), out=input.spec)

    return rule


def _dropout(func):
    def rule(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        spec, dim = input.spec, input.spec.dim
        def compute(t):
            mask = dropout_mask(func, input.shape, t, p)
            return t * own_part(strided_rows(mask, dim, spec), mask)

        return Step(compute, (input,), out=spec)

    return rule


def _along_other_dims(func):
    """``unbind``/``split``/``chunk`` along a dim other than the strided one: the slab rule, which is local there."""
    position = 0 if func in _UNBIND else 1  # unbind(input, dim); split/chunk(input, how, dim)

    def rule(input, *args, **kwargs):
        dim = args[position] if len(args) > position else kwargs.get("dim", 0)
        if dim % input.ndim == input.spec.dim:
            raise NotImplementedError(f"{op_name(func)} along the strided sharded dim {input.spec.dim}; reshape to the "
                                      "unstrided shape first")
        slab_rule = RULES.get(func)  # NOTE: looked up when called: its module may register it after this one's
        return slab_rule(input, *args, **kwargs)

    return rule


_UNBIND = {torch.unbind, torch.Tensor.unbind}
_DIM_LAST = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk} | _UNBIND


def _getitem(x, index):
    """Indexing that leaves the strided dim whole (``qkv[0]``, ``t[..., :c]``): local."""
    items = idioms.expand_index(index, x.ndim)
    seen, out_dim = -1, 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        seen += 1
        if seen == x.spec.dim:
            if item != slice(None):
                raise NotImplementedError(f"{op_name(torch.Tensor.__getitem__)} along the strided sharded dim "
                                          f"{x.spec.dim}; reshape to the unstrided shape first")
            break
        if not isinstance(item, int):
            if not isinstance(item, slice):
                raise NotImplementedError(f"{op_name(torch.Tensor.__getitem__)} with a tensor index on a strided "
                                          "domain tensor; reshape to the unstrided shape first")
            out_dim += 1
    return Step(lambda t: t[index], (x,), out=x.spec.with_sizes(x.spec.sizes, dim=out_dim))


def _softmax_dims(x, args, kwargs):
    dim = kwargs.get("dim", args[0] if args else None)
    return {dim % x.ndim} if dim is not None else set(range(x.ndim))


def _layer_norm_dims(x, args, kwargs):
    normalized = kwargs.get("normalized_shape", args[0] if args else ())
    return set(range(x.ndim - len(normalized), x.ndim))


for _f in pointwise.ELEMENTWISE:
    STRIDED_RULES.register(_f, elementwise_rule(_f))
# NOTE: the slab rules of these keep the spec's blocks (``with_sizes``) or handle them (reshapes): shared as they are.
for _f in (torch.Tensor.view, torch.reshape, torch.Tensor.reshape, torch.flatten, torch.Tensor.flatten,
           torch.unflatten, torch.Tensor.unflatten, torch.transpose, torch.Tensor.transpose, torch.permute,
           torch.Tensor.permute, torch.unsqueeze, torch.Tensor.unsqueeze, torch.squeeze, torch.Tensor.squeeze):
    _slab = RULES.get(_f)
    assert _slab is not None, f"the slab rule of {op_name(_f)} is registered before this module's"
    STRIDED_RULES.register(_f, _slab)
for _f in (torch.addmm, torch.Tensor.addmm, F.linear):
    STRIDED_RULES.register(_f, _rows_local(_f))
for _f in (torch.addmm, torch.Tensor.addmm):  # on slabs too (Conv1D of a batch of one merges nothing)
    RULES.register(_f, _rows_local(_f))
for _f in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm):
    STRIDED_RULES.register(_f, _matmul_of_rows(_f))
for _f in (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax):
    STRIDED_RULES.register(_f, _local_unless(_f, _softmax_dims))
STRIDED_RULES.register(F.layer_norm, _local_unless(F.layer_norm, _layer_norm_dims))
for _f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d):
    STRIDED_RULES.register(_f, _dropout(_f))
STRIDED_RULES.register(F.scaled_dot_product_attention, sdpa_rule)
for _f in _DIM_LAST:
    STRIDED_RULES.register(_f, _along_other_dims(_f))
STRIDED_RULES.register(torch.Tensor.__getitem__, _getitem)
