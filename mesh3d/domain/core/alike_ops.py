"""Element-wise ATen ops on wrapper domain tensors laid out alike: the floor answers them on the shards.

Usage (``mesh3d.domain.core.wrapped``'s floor)::

    if elementwise_aten(torch.ops.aten.mul.Tensor): ...     # 1: element-wise, writing nothing

Why it is right whoever calls: an element-wise op of tensors laid out alike (the same spec, the same shard shapes) and
of 0-d values (the same on every rank) is, shard by shard, the whole answer's shards. So the autograd engine's
backward formulas (of an op recorded on wrappers: ``torch.func``, checkpointed regions), a C++ extension's ``at::mul``
and TorchScript get the one-process answer here; everything else reaching the floor is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d._torch_private import make_wrapper_tensor
from mesh3d.domain.core.shard_owners import SHARD_OWNERS, version_of

__all__ = ["ENGINE_OPS", "alike_result", "elementwise_aten", "empty_in_order", "laid_out_alike", "same_layout",
           "wrapper_like"]


_aten = torch.ops.aten
#: Element-wise ATen ops torch does not tag pointwise: gradients of activations, and dtype conversions.
_ELEMENTWISE_UNTAGGED = frozenset({
    _aten.hardtanh_backward.default, _aten.leaky_relu_backward.default, _aten.elu_backward.default,
    _aten.softplus_backward.default, _aten.mish_backward.default, _aten.hardswish_backward.default,
    _aten.hardsigmoid_backward.default, _aten.softshrink_backward.default, _aten.hardshrink_backward.default,
    _aten.log_sigmoid_backward.default, _aten._to_copy.default, _aten.hardswish.default, _aten.fill.Scalar,
})


def elementwise_aten(func: Any) -> int:
    """An ATen op whose answer on shards laid out alike is the whole answer's shards: element-wise, writing nothing
    (1) or writing into its first argument only (2, ``logical_and_``, which autograd's formulas run on temporaries);
    0 for any other op."""
    known = _ELEMENTWISE_KNOWN.get(func)
    if known is None:
        schema = func._schema
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        alike = _alike_tagged(func)
        if not alike and written == [0] and schema.name.endswith("_"):  # NOTE: torch tags the functional form only
            packet = getattr(_aten, schema.name.split("::")[-1][:-1], None)
            functional = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
            alike = functional is not None and _alike_tagged(functional)
        known = _ELEMENTWISE_KNOWN[func] = 0 if not alike else 1 if not written else 2 if written == [0] else 0
    return known


_ELEMENTWISE_KNOWN: dict[Any, int] = {}


def _alike_tagged(func: Any) -> bool:
    # NOTE: never a random draw: each rank would draw its own numbers, not its part of the one-process draw
    tags = func.tags
    return (torch.Tag.pointwise in tags or func in _ELEMENTWISE_UNTAGGED) and torch.Tag.nondeterministic_seeded not in tags


def alike_result(cls: type, func: Any, out: Any, like: Any) -> Any:
    """An element-wise op's result on the shards as wrapper tensors (of type ``cls``) laid out as ``like`` (each of a
    tuple's)."""
    if isinstance(out, torch.Tensor):
        return cls(out, like._spec, like=like)
    if isinstance(out, tuple) and all(isinstance(o, torch.Tensor) and o.shape == like._local.shape for o in out):
        return tuple(cls(o, like._spec, like=like) for o in out)
    raise NotImplementedError(f"{func} answered an element-wise op on domain tensors with something other than "
                              "tensors of their shards' shape: mesh3d refuses it; call it on x.full_tensor()")


def wrapper_like(cls: type, local: torch.Tensor, like: Any) -> Any:
    """``cls(local, like._spec, like=like)``, eagerly, for an element-wise result ``local`` of ``like``'s shard shape
    (its operand's): the same tensor, made without the constructor's other cases; None where ``like`` is not dense or
    ``local`` is strided otherwise than ``like``'s shard (the constructor answers those).

    Usage: ``made = wrapper_like(WrappedDomainTensor, out, xs) or WrappedDomainTensor(out, xs.spec)``
    """
    if not like._dense or local.stride() != like._local.stride():
        return None
    out = make_wrapper_tensor(cls, like._whole, like._strides, local)
    out._whole, out._strides = like._whole, like._strides
    SHARD_OWNERS.mark(local, out)  # NOTE: as the constructor does, eager (``core.wrapped``)
    out._local, out._spec, out._alias, out._seen_version = local, like._spec, None, version_of(local)
    return out


def laid_out_alike(args: tuple, cls: Any) -> Any:
    """The first wrapper tensor (of type ``cls``) of ``args`` where every tensor among them is a wrapper laid out as it
    is or a 0-d value, and nothing is nested; else None."""
    like: Any = None
    for a in args:
        if type(a) is cls:
            if like is None:
                like = a
            elif (a._spec is not like._spec and a._spec != like._spec) or a._local.shape != like._local.shape:
                return None
        elif isinstance(a, (torch.Tensor, list, tuple, dict)) and not (isinstance(a, torch.Tensor) and a.ndim == 0):
            return None
    return like


#: ATen ops the floor runs on the shards, for wrapper tensors laid out alike and nothing else: what the autograd
#: engine and ``.grad`` accumulation run on gradients (sums of two, copies, detaching, tensors like one).
ENGINE_OPS = frozenset({
    torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor, torch.ops.aten.detach.default,
    torch.ops.aten.detach_.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
    torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.copy_.default, torch.ops.aten.zero_.default, torch.ops.aten.new_empty_strided.default,
})


def same_layout(wrapped: list[Any]) -> bool:
    """Whether the wrapper tensors ``wrapped`` share one spec and one shard shape. Usage: ``same_layout([a, b])``"""
    first = wrapped[0]
    return all(w._spec is first._spec or w._spec == first._spec for w in wrapped[1:]) and \
        all(w._local.shape == first._local.shape for w in wrapped[1:])


def empty_in_order(shape: torch.Size, strides: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``shape`` laid out in the memory order of ``strides`` (a whole tensor's): the shard of a new
    tensor laid out as one process lays it out (AccumulateGrad's ``new_empty_strided`` of a leaf's layout).

    Usage: ``local = empty_in_order(grad._local.shape, leaf_strides, grad._local)``
    """
    order = sorted(range(len(shape)), key=lambda d: -strides[d])  # NOTE: outermost first; ties keep the dims' order
    local, step = [0] * len(shape), 1
    for d in reversed(order):
        local[d] = step
        step *= max(shape[d], 1)
    return torch.empty_strided(tuple(shape), tuple(local), dtype=like.dtype, device=like.device)
