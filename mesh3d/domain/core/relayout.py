"""A wrapper domain tensor made a view's metadata: the strides and storage offset one process gives the view.

Usage (``mesh3d.domain.dispatch.writes.record_views``, on a view function's result)::

    o = relayout(o, strides, offset)     # o's shard, o's history, the one-process view's strides and offset

Why: a wrapper tensor made from a shard takes the whole tensor's strides from the shard's memory order
(``tensor.global_strides_for``), which is the one-process answer for a tensor of its own memory. A view is not one:
``x[:, :, 1:]`` keeps its base's strides and starts past the first row, and a shard of one row, or an empty one, is
contiguous where its peers' are not. So ``stride()``, ``is_contiguous()`` and ``storage_offset()`` answered as a new
contiguous tensor on some ranks only, and a ``view`` of such a view ran on those ranks and raised on the others.
The one-process answer is torch's own on meta tensors of the whole tensors (``dispatch.view_semantics``).
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d._torch_private import functorch_transform_active, run_autograd_function
from mesh3d.domain.core.wrapped import WrappedDomainTensor

__all__ = ["relayout"]


def relayout(view: WrappedDomainTensor, strides: tuple[int, ...], offset: int) -> WrappedDomainTensor:
    """``view``'s shard and history in a wrapper tensor of the given (one-process) strides and storage offset."""
    if view.requires_grad and torch.is_grad_enabled() and not functorch_transform_active():
        # NOTE: under torch.func the shards carry the history (``core.wrapped``): a holder without an edge there
        return run_autograd_function(_Relayout, (view, strides, offset), {})
    return _relaid(view, strides, offset)


def _relaid(view: WrappedDomainTensor, strides: tuple[int, ...], offset: int) -> WrappedDomainTensor:
    out = WrappedDomainTensor(view._local, view._spec, layout=(strides, offset))
    out._views_domain = view._views_domain
    return out


# NOTE: forward(ctx, ...) without setup_context, as core.wrapped's edges (torch.func takes the branch above)
class _Relayout(torch.autograd.Function):
    """The same tensor with the one-process view's metadata; its gradient is the view's."""

    @staticmethod
    def forward(ctx: Any, view: WrappedDomainTensor, strides: tuple[int, ...], offset: int) -> WrappedDomainTensor:
        ctx.set_materialize_grads(False)
        return _relaid(view, strides, offset)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
        return grad, None, None
