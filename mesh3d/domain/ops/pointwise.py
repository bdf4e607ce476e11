"""Element-wise ops, channel-dim ops (Linear, softmax over a channel), cat, transpose and dropout.

Usage: automatic; ``torch.relu(xs)``, ``xs * 2 + ys``, ``nn.Linear`` over channels-last, ``torch.cat``
of skip connections along channels all return domain tensors with the same sharding.

An element-wise op is exact on shards when every operand is sharded the same way; a plain tensor
operand must not vary along the sharded dim (broadcast size 1), else it raises (shard it first).
A replicated value (a global reduction's result) entering the shards gets ``sum_grad`` so its
gradient is the sum of the shards' partial gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d.domain.collectives import sum_grad
from mesh3d.domain.registry import flat_tensors, op_name, register, tree_map
from mesh3d.domain.tensor import DomainTensor, adopt, unwrap

__all__ = ["elementwise"]

_NAMES = (
    "add sub mul div true_divide rsub neg abs exp log sqrt rsqrt sin cos tanh sigmoid relu pow clamp clamp_min "
    "clamp_max where maximum minimum square reciprocal sign erf log1p expm1 lerp addcmul addcdiv floor ceil round "
    "exp2 log2 sinh cosh atan2 hypot fmod remainder gt lt ge le eq ne logical_and logical_or logical_not isnan "
    "isfinite nan_to_num masked_fill zeros_like ones_like full_like empty_like detach clone contiguous to float "
    "double half bfloat16 type type_as cpu cuda detach_ zero_ fill_ copy_ sub_ add_ mul_ div_ relu_ clamp_ "
    "sigmoid_ tanh_ neg_ pow_ abs_ exp_ masked_fill_ float_power"
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
for _n in _F_NAMES:
    if hasattr(F, _n):
        ELEMENTWISE.add(getattr(F, _n))


def _sharded(ts: list) -> list[DomainTensor]:
    return [t for t in ts if isinstance(t, DomainTensor) and t.spec.dim is not None]


def _check_same_sharding(func, sharded: list[DomainTensor]) -> DomainTensor:
    ref = sharded[0]
    for t in sharded[1:]:
        if t.ndim - t.spec.dim != ref.ndim - ref.spec.dim or sum(t.spec.sizes) != sum(ref.spec.sizes):
            raise ValueError(
                f"{op_name(func)}: domain tensors sharded along different dims or lengths (dim {ref.spec.dim} sizes "
                f"{ref.spec.sizes} vs dim {t.spec.dim} sizes {t.spec.sizes}); shard both along the same dim"
            )
    return ref


def _same_layout(ref: DomainTensor, o):
    """Operands sharded along the same dim but with other sizes (e.g. a U-Net skip) move rows to ``ref``'s."""
    if isinstance(o, DomainTensor) and o.spec.dim is not None and o.spec.sizes != ref.spec.sizes:
        from mesh3d.domain.api import redistribute

        return redistribute(o, ref.spec.sizes)
    return o


def elementwise(func, *args, **kwargs):
    """Run an element-wise op on the local shards; output sharded like the inputs."""
    tensors = flat_tensors((args, kwargs))
    ref = _check_same_sharding(func, _sharded(tensors))
    out_ndim = max(t.ndim for t in tensors)
    out_dim = ref.spec.dim + (out_ndim - ref.ndim)

    def prepare(o):
        o = _same_layout(ref, o)
        if not isinstance(o, torch.Tensor) or (isinstance(o, DomainTensor) and o.spec.dim is not None):
            return unwrap(o)
        aligned = out_dim - (out_ndim - o.ndim)
        if aligned >= 0 and o.shape[aligned] != 1:
            raise ValueError(
                f"{op_name(func)}: a non-sharded tensor of shape {tuple(o.shape)} varies along the sharded dim "
                f"{out_dim} of a domain tensor (global shape {tuple(ref.global_shape)}); shard it too with "
                f"domain.shard(t, dim={aligned}, sizes={ref.spec.sizes}) or give it size 1 there"
            )
        if isinstance(o, DomainTensor):  # replicated value entering the shards
            plain = unwrap(o)
            return sum_grad(plain, o.spec.comm) if plain.requires_grad else plain
        return o

    out = func(*tree_map(prepare, args), **tree_map(prepare, kwargs))
    spec = ref.spec.with_sizes(ref.spec.sizes, dim=out_dim)
    plain = tuple(t for t in tensors if not isinstance(t, DomainTensor))
    return tree_map(lambda o: adopt(o, spec, plain) if isinstance(o, torch.Tensor) and o.ndim == out_ndim else o, out)


for _f in ELEMENTWISE:
    register(_f)(lambda *a, _f=_f, **k: elementwise(_f, *a, **k))


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def local_unless_sharded(func, x: DomainTensor, dims, what: str, *args, **kwargs):
    """Run ``func`` locally when it does not act along the sharded dim, else raise naming it."""
    if x.spec.dim in [_norm_dim(d, x.ndim) for d in dims]:
        raise NotImplementedError(
            f"{op_name(func)} acts along dim {x.spec.dim}, which is sharded over the domain ({what}); "
            "call .full_tensor() first or shard a different dim"
        )
    # The other arguments (weights) act along non-sharded dims only: run on the local shard as is.
    return adopt(func(unwrap(x), *args, **kwargs), x.spec)


@register(F.linear)
def _linear(input, weight, bias=None):
    return local_unless_sharded(F.linear, input, [-1], "Linear mixes the last dim", weight, bias)


for _sm in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax):
    register(_sm)(
        lambda input, dim, *a, _sm=_sm, **k: local_unless_sharded(_sm, input, [dim], "softmax", dim, *a, **k)
    )


@register(torch.cat, torch.concat)
def _cat(tensors, dim=0):
    ref = _check_same_sharding(torch.cat, _sharded(list(tensors)))
    if _norm_dim(dim, ref.ndim) == ref.spec.dim:
        raise NotImplementedError(
            f"torch.cat along the sharded dim {ref.spec.dim} is not supported; concatenate along another dim"
        )
    for t in tensors:
        if not isinstance(t, DomainTensor):
            raise ValueError("torch.cat: every input must be a domain tensor sharded the same way; shard the plain one")
    return adopt(torch.cat([unwrap(_same_layout(ref, t)) for t in tensors], dim), ref.spec)


@register(torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes)
def _transpose(x, dim0, dim1):
    d0, d1 = _norm_dim(dim0, x.ndim), _norm_dim(dim1, x.ndim)
    new = {d0: d1, d1: d0}.get(x.spec.dim, x.spec.dim)
    return adopt(torch.transpose(unwrap(x), d0, d1), x.spec.with_sizes(x.spec.sizes, dim=new))


@register(torch.permute, torch.Tensor.permute)
def _permute(x, *dims):
    dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
    dims = tuple(_norm_dim(d, x.ndim) for d in dims)
    return adopt(unwrap(x).permute(dims), x.spec.with_sizes(x.spec.sizes, dim=dims.index(x.spec.dim)))


@register(F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout)
def _dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    raise NotImplementedError(
        "dropout in training mode on a domain tensor is not supported: a per-shard random mask would not match "
        "one process; use p=0 or model.eval() on the domain-sharded part, or apply dropout after .full_tensor()"
    )


@register(torch.Tensor.view_as)
def _view_as(x, other):
    # FSDP2 calls ``x.view_as(x)`` on every forward input to hook its backward; a view onto an
    # identically sharded tensor of the same shape is exact on shards. Anything else would
    # reinterpret rows across the shard boundary, so it is refused.
    if isinstance(x, DomainTensor) and isinstance(other, DomainTensor) and x.spec == other.spec and x.shape == other.shape:
        return adopt(unwrap(x).view_as(unwrap(other)), x.spec)
    raise NotImplementedError(
        "torch.Tensor.view_as on a domain tensor is supported only onto an identically sharded tensor of "
        "the same shape; call .full_tensor() first"
    )
