"""Finite differences along any dim, the sharded one included: ``torch.diff``, ``torch.gradient``, ``torch.trapezoid``.

Usage: on a domain tensor ``torch.diff(u, dim=2)``, ``du_dy, du_dx = torch.gradient(u, spacing=(dy, dx), dim=(2, 3))``
and ``torch.trapezoid(u, dx=dx, dim=2)`` give the one-process values (PINN and CFD residuals, quadratures).

Each is torch's own formula (aten ``diff``, ``gradient_helper_float``, ``do_trapezoid``: the same slices, the same
order of operations), written with ``composite.call`` on the domain tensor: a slice along the sharded dim is laid out by
global index, and the operands of a difference are aligned by the element-wise rule, so the rows a rank needs from its
neighbour (one, or two for ``edge_order=2``) travel as a halo would.
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d.domain.core.tensor import size_of
from mesh3d.domain.ops.composite import call, register_composite

__all__: list[str] = []


def _rows(x: Any, d: int, start: int, stop: int | None = None) -> Any:
    """``x[..., start:stop, ...]`` along ``d`` (negative bounds from the end), by global index."""
    n = size_of(x)[d]
    first = start % n if start < 0 else start
    last = n if stop is None else (stop % n if stop < 0 else stop)
    return call(torch.Tensor.__getitem__, x, (slice(None),) * d + (slice(first, last),))


@register_composite(torch.diff, torch.Tensor.diff)
def _diff(input, n=1, dim=-1, prepend=None, append=None):
    d = dim % input.ndim
    if prepend is not None or append is not None:
        pieces = [t for t in (prepend, input, append) if t is not None]
        input = call(torch.cat, pieces, d)
    if n < 0:
        raise ValueError(f"torch.diff: order n={n} must be non-negative")
    step = torch.ne if input.dtype == torch.bool else torch.sub  # as torch: a bool difference is an exclusive or
    for _ in range(n):
        length = size_of(input)[d]
        if length == 0:
            break
        input = call(step, _rows(input, d, 1), _rows(input, d, 0, length - 1))
    return input


def _spacings(spacing: Any, count: int) -> list[float]:
    if isinstance(spacing, (int, float)):
        return [float(spacing)] * count
    values = list(spacing)
    if any(isinstance(v, torch.Tensor) for v in values):
        raise NotImplementedError("torch.gradient with coordinate tensors as spacing on a domain tensor: give uniform "
                                  "spacings (numbers, one per dim), or call .full_tensor() first")
    if len(values) == 1:
        return [float(values[0])] * count
    if len(values) != count:
        raise ValueError(f"torch.gradient: {len(values)} spacings for {count} dims; give one per dim (or one for all)")
    return [float(v) for v in values]


@register_composite(torch.gradient)
def _gradient(input, *, spacing=1, dim=None, edge_order=1):
    dims = list(range(input.ndim)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    dims = [d % input.ndim for d in dims]
    if edge_order not in (1, 2):
        raise ValueError(f"torch.gradient: edge_order={edge_order} must be 1 or 2")
    shape = size_of(input)
    if any(shape[d] < edge_order + 1 for d in dims):
        raise ValueError(f"torch.gradient: each dim differentiated needs at least edge_order + 1 = {edge_order + 1} "
                         f"points; the sizes are {tuple(shape[d] for d in dims)}")
    results = []
    for d, h in zip(dims, _spacings(spacing, len(dims))):
        center = call(torch.div, call(torch.sub, _rows(input, d, 2), _rows(input, d, 0, -2)), h)
        if edge_order == 1:
            first = call(torch.div, call(torch.sub, _rows(input, d, 1, 2), _rows(input, d, 0, 1)), h)
            last = call(torch.div, call(torch.sub, _rows(input, d, -1), _rows(input, d, -2, -1)), h)
        else:
            first = call(torch.div, call(torch.sub, call(torch.add, call(torch.mul, _rows(input, d, 0, 1), -1.5),
                                                                   call(torch.mul, _rows(input, d, 1, 2), 2)),
                                         call(torch.mul, _rows(input, d, 2, 3), 0.5)), h)
            last = call(torch.div, call(torch.add, call(torch.sub, call(torch.mul, _rows(input, d, -3, -2), 0.5),
                                                                   call(torch.mul, _rows(input, d, -2, -1), 2)),
                                        call(torch.mul, _rows(input, d, -1), 1.5)), h)
        results.append(call(torch.cat, [first, call(torch.div, center, 2), last], d))
    return tuple(results)


@register_composite(torch.trapezoid, torch.trapz)
def _trapezoid(y, x=None, *, dx=None, dim=-1):
    d = dim % y.ndim
    length = size_of(y)[d]
    if x is not None and dx is not None:
        raise TypeError("torch.trapezoid: give x or dx, not both")
    if isinstance(x, (int, float)):  # torch.trapz(y, dx, dim) passes the spacing second
        x, dx = None, x
    if length == 0:
        return call(torch.sum, y, d)  # zeros of the remaining shape, as torch
    if x is None:
        step = 1.0 if dx is None else float(dx)
        # NOTE: Tensor.select, not torch.select: torch_geometric replaces torch.select with its own on import
        ends = call(torch.mul, call(torch.add, call(torch.Tensor.select, y, d, 0), call(torch.Tensor.select, y, d, -1)),
                    0.5)
        return call(torch.mul, call(torch.sub, call(torch.sum, y, d), ends), step)
    if x.ndim == 1:
        if size_of(x)[0] != length:
            raise ValueError(f"torch.trapezoid: x has {size_of(x)[0]} points along dim {d}, y {length}")
        widths = call(torch.Tensor.view, call(torch.diff, x), [-1 if i == d else 1 for i in range(y.ndim)])
    else:  # fewer dims than y: ones in front, as torch views it
        x = call(torch.Tensor.view, x, [1] * (y.ndim - x.ndim) + list(size_of(x))) if x.ndim < y.ndim else x
        widths = call(torch.diff, x, dim=d)
    heights = call(torch.add, _rows(y, d, 1), _rows(y, d, 0, length - 1))
    return call(torch.div, call(torch.sum, call(torch.mul, widths, heights), d), 2.0)
