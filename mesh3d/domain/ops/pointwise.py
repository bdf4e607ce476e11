"""Element-wise ops, channel-dim ops (Linear, softmax over a channel), cat and transpose.

Usage: automatic; ``torch.relu(xs)``, ``xs * 2 + ys``, ``nn.Linear`` over channels-last, ``torch.cat``
of skip connections along channels all return domain tensors with the same sharding.

An element-wise op is exact on shards when every operand is sharded the same way; a plain tensor
operand must not vary along the sharded dim (broadcast size 1), else it raises (shard it first).
A replicated value (a global reduction's result) entering the shards gets ``sum_grad`` so its
gradient is the sum of the shards' partial gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from mesh3d._torch_private import linear_not_a_view
from mesh3d.domain.dispatch.dispatcher import run_step
from mesh3d.domain.ops.idioms import cat_along_sharded, replicated_slice
from mesh3d.domain.dispatch.registry import (
    BLOCK_RULES, RULES, STRIDED_RULES, TOKEN_RULES, op_name, register, writes_into_first)
from mesh3d.domain.dispatch.elementwise_plan import plan_elementwise
from mesh3d.domain.dispatch.step import Entering, Resplit, Step, whole_operand
from mesh3d.domain.core.tensor import DomainTensor, detach_in_place, size_of
from mesh3d.domain.layouts.transpose import move_sharding

__all__ = ["elementwise", "elementwise_rule", "elementwise_step", "refuse_other_forms"]

_NAMES = (
    "add sub mul div true_divide rsub neg abs exp log sqrt rsqrt sin cos tanh sigmoid relu pow clamp clamp_min "
    "clamp_max where maximum minimum square reciprocal sign erf log1p expm1 lerp addcmul addcdiv floor ceil round "
    "exp2 log2 sinh cosh atan2 hypot fmod remainder gt lt ge le eq ne logical_and logical_or logical_not isnan isinf "
    "isposinf isneginf signbit xlogy logaddexp logaddexp2 isclose "
    "isfinite nan_to_num masked_fill zeros_like ones_like full_like empty_like detach clone contiguous to float "
    "double half bfloat16 long int short bool byte char type type_as cpu cuda zero_ fill_ copy_ sub_ add_ "
    "mul_ div_ relu_ clamp_ complex polar "
    "sigmoid_ tanh_ neg_ pow_ abs_ exp_ masked_fill_ float_power lerp_ addcmul_ addcdiv_ sqrt_ clamp_min_ clamp_max_ "
    "maximum_ minimum_ square_ reciprocal_ sign_"
).split()
_DUNDER = (
    "__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ "
    "__itruediv__ __neg__ __pow__ __rpow__ __abs__ __gt__ __lt__ __ge__ __le__ __eq__ __ne__ __and__ __or__ "
    "__invert__ __mod__ __floordiv__"
).split()
_F_NAMES = (
    "relu relu_ gelu silu leaky_relu leaky_relu_ elu elu_ selu celu softplus tanh sigmoid hardtanh hardtanh_ relu6 "
    "mish hardswish hardsigmoid logsigmoid softsign tanhshrink threshold glu_ prelu"
).split()

ELEMENTWISE: set = set()
for _n in _NAMES:
    for _owner in (torch, torch.Tensor):
        if hasattr(_owner, _n):
            ELEMENTWISE.add(getattr(_owner, _n))
for _n in _DUNDER:
    if hasattr(torch.Tensor, _n):
        ELEMENTWISE.add(getattr(torch.Tensor, _n))
ELEMENTWISE.update((torch.special.xlogy, torch.special.xlog1py))
for _n in _F_NAMES:
    if hasattr(F, _n):
        ELEMENTWISE.add(getattr(F, _n))


def _sharded(ts) -> list[DomainTensor]:
    return [t for t in ts if isinstance(t, DomainTensor) and t._spec.dim is not None]


def _check_same_sharding(func, sharded: list[DomainTensor]) -> DomainTensor:
    ref = sharded[0]
    for t in sharded[1:]:
        if t.ndim - t._spec.dim != ref.ndim - ref._spec.dim or sum(t._spec.sizes) != sum(ref._spec.sizes):
            raise ValueError(
                f"{op_name(func)}: domain tensors sharded along different dims or lengths (dim {ref.spec.dim} sizes "
                f"{ref.spec.sizes} vs dim {t.spec.dim} sizes {t.spec.sizes}); shard both along the same dim"
            )
    return ref


def _in_ref_layout(ref: DomainTensor, o):
    """A sharded operand in ``ref``'s layout: as is, or moved there (e.g. a U-Net skip with other sizes)."""
    if o._spec.sizes != ref._spec.sizes:
        return Resplit(o, ref._spec.sizes)
    return o


def refuse_other_forms(func, args: tuple, kwargs: dict) -> None:
    """Raise for the calls of an element-wise op's name that are not element-wise: ``torch.where(condition)`` alone
    is ``nonzero`` (the indices of the true elements, which depend on every rank's rows).

    Usage: ``refuse_other_forms(torch.where, args, kwargs)`` first in an element-wise rule
    """
    if func is torch.where and len(args) + len(kwargs) < 2:
        raise NotImplementedError(
            "torch.where(condition) with the condition alone (torch.nonzero(condition, as_tuple=True)) on a domain "
            "tensor gives global indices that depend on every rank's rows: mesh3d has no rule for it. Call it on "
            ".full_tensor(), or use the three-argument torch.where(condition, x, y)")


def elementwise_step(func, args: tuple, kwargs: dict) -> Step:
    """Declare an element-wise op: operands in one layout, plain ones constant along the sharded dim.

    Usage: ``run_step(elementwise_step(torch.add, (xs, ys), {}))``
    """
    refuse_other_forms(func, args, kwargs)
    operands = [*args, *kwargs.values()]
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    ref = _check_same_sharding(func, _sharded(tensors))
    if writes_into_first(func) and args and not (isinstance(args[0], DomainTensor) and args[0].spec.dim is not None):
        raise NotImplementedError(
            f"{op_name(func)} writes a domain-sharded value into a tensor that is whole on every rank (shape "
            f"{tuple(args[0].shape)}): each rank would write only its own rows. Compute it out of place "
            f"(y = t + xs), write into a domain tensor (xs.new_zeros(...)), or assign t[...] = xs (which gathers xs)")
    out_ndim = max(t.ndim for t in tensors)
    out_dim = ref._spec.dim + (out_ndim - ref.ndim)

    def requirement(o):
        if not isinstance(o, torch.Tensor):
            return o
        if isinstance(o, DomainTensor) and o._spec.dim is not None:
            return _in_ref_layout(ref, o)
        aligned = out_dim - (out_ndim - o.ndim)
        if aligned >= 0 and size_of(o)[aligned] == sum(ref._spec.sizes) != 1:
            return replicated_slice(o, aligned, ref)  # a position embedding: this rank's rows of it
        if aligned >= 0 and size_of(o)[aligned] != 1:
            raise ValueError(
                f"{op_name(func)}: a non-sharded tensor of shape {tuple(o.shape)} varies along the sharded dim "
                f"{out_dim} of a domain tensor (global shape {tuple(ref.global_shape)}); give it the global length there "
                f"(then each rank takes its rows), shard it too with "
                f"domain.shard(t, dim={aligned}, sizes={ref.spec.sizes}) or give it size 1 there"
            )
        return Entering(o) if isinstance(o, DomainTensor) else o  # a replicated value entering the shards

    spec = ref._spec if out_dim == ref._spec.dim else ref._spec.with_sizes(ref._spec.sizes, dim=out_dim)
    return Step(func, tuple(requirement(a) for a in args), {k: requirement(v) for k, v in kwargs.items()},
                out=spec, out_ndim=out_ndim, keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))


def elementwise(func, *args, **kwargs):
    """Run an element-wise op on the local shards now; output sharded like the inputs.

    Usage: ``elementwise(torch.neg, xs)``
    """
    return run_step(elementwise_step(func, args, kwargs))


def elementwise_rule(func: Callable) -> Callable:
    """The slab rule of an element-wise op ``func``.

    Usage: ``RULES.register(torch.ops.mylib.act.default, elementwise_rule(torch.ops.mylib.act.default))``
    """
    return lambda *a, **k: elementwise_step(func, a, k)


for _f in ELEMENTWISE:
    register(_f)(elementwise_rule(_f))


for _table in (RULES, STRIDED_RULES, BLOCK_RULES, TOKEN_RULES):
    for _f in (torch.Tensor.detach_, torch.detach_):
        _table.register(_f, detach_in_place)


#: Element-wise functions whose calls on one slab layout are answered from their operands' metadata
#: (``dispatch.elementwise_plan``): all but the writes and those that may return no tensor of the operands' shape
#: (``type()``, ``where(cond)``; ``detach_`` has a rule of its own).
_NO_PLAN = {torch.Tensor.type, torch.where, torch.Tensor.where}
for _f in ELEMENTWISE - _NO_PLAN:
    if not writes_into_first(_f):
        plan_elementwise(_f)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def local_unless_sharded(func, x: DomainTensor, dims, what: str, *args, **kwargs) -> Step:
    """Run ``func`` locally when it does not act along the sharded dim, else raise naming it."""
    if x.spec.dim in [_norm_dim(d, x.ndim) for d in dims]:
        raise NotImplementedError(
            f"{op_name(func)} acts along dim {x.spec.dim}, which is sharded over the domain ({what}); "
            "call .full_tensor() first or shard a different dim"
        )
    # The other arguments (weights) act along non-sharded dims only: run on the local shard as is.
    return Step(func, (x, *args), kwargs, out=x.spec)


@register(F.linear)
def _linear(input, weight, bias=None) -> Step:
    # NOTE: the local product is not a view (``linear_not_a_view`` says why: FSDP2's hook on a Linear unit's output)
    step = local_unless_sharded(F.linear, input, [-1], "Linear mixes the last dim", whole_operand(weight, "F.linear"),
                                whole_operand(bias, "F.linear"))
    return replace(step, compute=linear_not_a_view)


@register(torch.cat, torch.concat)
def _cat(tensors, dim=0) -> Step:
    # torch.cat skips 1-D empty tensors next to higher-dim ones (a legacy rule that KV caches start from)
    tensors = [t for t in tensors if not (isinstance(t, torch.Tensor) and t.ndim == 1 and t.numel() == 0)] or tensors
    sharded = _sharded(tensors)
    along = [t for t in sharded if _norm_dim(dim, t.ndim) == t.spec.dim]
    first = along[0] if along else sharded[0]
    if any(t.ndim - t.spec.dim != first.ndim - first.spec.dim for t in sharded):
        # NOTE: a piece sharded along another dim than the first piece sharded along the cat dim (or, if none is, than
        # the first sharded piece) moves its sharding there (an all-to-all: a halo turned by rot90 beside a face's
        # rows, cube-sphere style), at the first piece's sizes unless the pieces join along that dim
        joined = _norm_dim(dim, first.ndim) == first.spec.dim
        tensors = [move_sharding(t, t.ndim - (first.ndim - first.spec.dim), None if joined else first.spec.sizes)
                   if isinstance(t, DomainTensor) and t.spec.dim is not None
                   and t.ndim - t.spec.dim != first.ndim - first.spec.dim else t for t in tensors]
    if _norm_dim(dim, first.ndim) == first.spec.dim:  # pieces of any lengths along the sharded dim
        return cat_along_sharded(tensors, first.spec.dim, first)
    ref = _check_same_sharding(torch.cat, _sharded(tensors))
    length = sum(ref.spec.sizes)

    def requirement(t):
        if isinstance(t, DomainTensor) and t.spec.dim is not None:
            return _in_ref_layout(ref, t)
        if t.ndim == ref.ndim and t.shape[ref.spec.dim] == length:  # e.g. a coordinate channel of global length
            return replicated_slice(t, ref.spec.dim, ref)
        raise ValueError(f"torch.cat along dim {dim}: a tensor of shape {tuple(t.shape)} next to a domain tensor of "
                         f"global shape {tuple(ref.shape)}; give it the global length {length} at the sharded dim "
                         f"{ref.spec.dim} (each rank then takes its rows), or shard it too")

    return Step(lambda *ts: torch.cat(ts, dim), tuple(requirement(t) for t in tensors), out=ref.spec,
                keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))


@register(torch.stack)
def _stack(tensors, dim=0):
    """``torch.stack`` as a ``cat`` of unsqueezed operands (the new dim is never the sharded one)."""
    d = dim % (tensors[0].ndim + 1)
    return torch.cat([t.unsqueeze(d) for t in tensors], d)


@register(torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes)
def _transpose(input, dim0, dim1) -> Step:
    d0, d1 = _norm_dim(dim0, input.ndim), _norm_dim(dim1, input.ndim)
    new = {d0: d1, d1: d0}.get(input.spec.dim, input.spec.dim)
    return Step(lambda t: torch.transpose(t, d0, d1), (input,), out=input.spec.with_sizes(input.spec.sizes, dim=new))


@register(torch.permute, torch.Tensor.permute)
def _permute(input, *dims) -> Step:
    dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
    dims = tuple(_norm_dim(d, input.ndim) for d in dims)
    return Step(lambda t: t.permute(dims), (input,),
                out=input.spec.with_sizes(input.spec.sizes, dim=dims.index(input.spec.dim)))


@register(torch.Tensor.view_as)
def _view_as(input, other) -> Step:
    # FSDP2 calls ``x.view_as(x)`` on every forward input to hook its backward; a view onto an
    # identically sharded tensor of the same shape is exact on shards. Anything else would
    # reinterpret rows across the shard boundary, so it is refused.
    if isinstance(input, DomainTensor) and isinstance(other, DomainTensor) and input.spec == other.spec \
            and size_of(input) == size_of(other):
        return Step(lambda t, o: t.view_as(o), (input, other), out=input.spec)
    raise NotImplementedError(
        "torch.Tensor.view_as on a domain tensor is supported only onto an identically sharded tensor of "
        "the same shape; call .full_tensor() first"
    )
