"""A linear map given by two plain functions, differentiable to any order: its backward is its adjoint, whose
backward is the map again.

Usage::

    whole = linear_op(gather, keep_own, local)             # a move of rows in a forward: its gradient the adjoint
    out = linear_map(lambda g: gather(g), lambda g: scatter_add(g), local)   # in a backward: recorded to any order

Every move of rows between domain ranks (a halo, a gather, a transpose) is linear, and its gradient is the adjoint
move. An ``autograd.Function`` whose backward computes that adjoint with no-grad code gives first derivatives only:
``torch.autograd.grad(..., create_graph=True)`` (second derivatives: a Laplacian in a physics-informed loss) needs
the backward itself recorded. Called from a backward that runs with ``create_graph=True`` (grad mode on there),
``linear_map(adjoint, apply, grad)`` records one node whose own backward is ``apply``: the pair nests to any order.
With ``create_graph=False`` the engine runs backward with grad mode off, and the call is the plain function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import functorch_transform_active

__all__ = ["linear_map", "linear_op", "recordable"]


def _tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _LinearMap(torch.autograd.Function):
    """``apply(*tensors)``; backward ``adjoint``, whose own backward is ``again``."""

    @staticmethod
    def forward(apply: Callable, adjoint: Callable, again: Callable, *tensors: torch.Tensor):
        with torch.no_grad():
            out = apply(*tensors)
        outs = tuple(o.view_as(o) if any(o is t for t in tensors) else o for o in _tuple(out))
        return outs if isinstance(out, (tuple, list)) else outs[0]

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:  # NOTE: torch.func's transforms run only this form
        ctx.maps = inputs[1:3]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        adjoint, again = ctx.maps
        return (None, None, None, *_tuple(linear_map(adjoint, again, *grads)))


def recordable(t: torch.Tensor) -> torch.Tensor:
    """``t``, made to require grad if it does not (a detached leaf): a recorded exchange then exists on every rank.

    Usage: ``_LinearMap.apply(apply, adjoint, apply, recordable(grad))`` in a backward run with ``create_graph=True``

    NOTE: whether a gradient requires grad can differ between ranks (an empty shard's is often a constant zero).
    A node recorded on some ranks only would run its exchange on those ranks alone in the next backward, so the
    rule is global: with ``create_graph=True`` every rank records every exchange; a constant's own gradient then
    accumulates into a leaf nobody reads.
    """
    if t.requires_grad or functorch_transform_active():  # NOTE: there the transform records every op itself
        return t
    return t.detach().requires_grad_()


def linear_map(apply: Callable[..., Any], adjoint: Callable[..., Any], *tensors: torch.Tensor) -> Any:
    """``apply(*tensors)`` (a linear map of plain tensors, one result or a tuple), whose gradient is
    ``adjoint(*grads of the results)`` (one gradient per tensor, a tuple when several), to any order.

    Usage: ``return linear_map(scatter_back, gather, grad)`` in a backward (recorded when ``create_graph=True``)
    """
    if not torch.is_grad_enabled():
        with torch.no_grad():
            return apply(*tensors)
    return _LinearMap.apply(apply, adjoint, apply, *(recordable(t) for t in tensors))


def linear_op(apply: Callable[..., Any], adjoint: Callable[..., Any], *tensors: torch.Tensor,
              again: Callable[..., Any] | None = None) -> Any:
    """``apply(*tensors)`` in a forward (a move of rows between ranks: a halo, a gather, a transpose), recorded where
    a tensor requires grad: its gradient is ``adjoint(*grads)``, whose own gradient is ``again`` (``apply`` unless
    the forward differs from the map it stands for: a gather whose fill rows hold a value), to any order.

    Usage: ``whole = linear_op(lambda t: gather_whole(t, spec), lambda g: own_block(g, spec), local)``

    NOTE: one autograd Function for every move (there was one per move, each a copy of this): ``apply``, ``adjoint``
    and ``again`` close over plans and specs, never over tensors.
    """
    return _LinearMap.apply(apply, adjoint, again or apply, *tensors)
