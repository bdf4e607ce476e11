"""Graph rules that cut a tensor into pieces along a dim other than the items, and the transposes: ``unbind``,
``split``, ``chunk``, ``t()`` / ``.T``. Cutting along the item dim (a Python loop over the items) is refused.

Usage (through torch)::

    src, dst = edge_index                   # Tensor.__iter__ is unbind(0): row 0 the sources, row 1 the destinations
    src, dst = edge_index.unbind(0)
    s, d = edge_index.split(1)              # (1, E) rows; .squeeze(0) / .view(-1) / .flatten() make them 1-D rows
    s, d = edge_index.chunk(2)
    ea, eb = edge_attr.split([3, 2], dim=-1)  # along features: pieces laid out as the edges
    pairs = edge_index.t()                  # (E, 2): the item dim first; iterating over it is refused

Each piece keeps the items' partition. A piece of the ``(2, E)`` edge list that is one of its rows knows which
(its ``endpoint``), so gathers and aggregations by it are planned as for ``edge_index[0]`` / ``edge_index[1]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from mesh3d.domain.core.specs import GraphSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.kept_steps import layout_rule
from mesh3d.domain.dispatch.registry import GRAPH_RULES
from mesh3d.domain.ops.graph.common import graph_spec_of

__all__ = ["refuse_item_loop", "row_endpoint"]


def refuse_item_loop(op: str, spec: GraphSpec) -> None:
    """Raise for a cut along the item dim: the loop over items it feeds would see this rank's items only.

    Usage: ``refuse_item_loop("torch.Tensor.unbind", x.spec)``
    """
    raise NotImplementedError(
        f"{op} along the item dim {spec.dim} of a graph tensor (a Python loop over its items, e.g. "
        "`for s, d in edge_index.t()` or `list(x)`): each rank holds only its own items while len() and .shape answer "
        "the global count, so the loop would silently see a part of the graph. Use tensor ops over every item at once "
        "(src, dst = edge_index; x[src]; index_add_ / scatter_reduce at dst), or call .full_tensor() first")


def row_endpoint(spec: GraphSpec, dim: int, rows: range) -> int | None:
    """The endpoint of a piece made of ``rows`` along ``dim`` of a tensor of ``spec``: for the ``(2, E)`` edge list
    cut along dim 0, the row it is (-1 when it is both rows in order, None when none); otherwise the tensor's own
    (the values are kept).

    Usage: ``row_endpoint(ei.spec, 0, range(1, 2))  # 1: the destinations``
    """
    if spec.endpoint != -1 or spec.dim != 1 or dim != 0:
        return spec.endpoint
    if len(rows) == 1:
        return rows[0]
    return -1 if list(rows) == [0, 1] else None


def _unbind(input: DomainTensor, dim: int = 0) -> tuple[DomainTensor, ...]:
    spec = graph_spec_of(input)
    d = dim % input.ndim
    if d == spec.dim:
        refuse_item_loop("torch.Tensor.unbind", spec)
    new = spec.dim - (d < spec.dim)
    return tuple(adopt(t, spec.replaced(dim=new, endpoint=row_endpoint(spec, d, range(i, i + 1))))
                 for i, t in enumerate(torch.unbind(unwrap(input), d)))


_NAMES = {torch.split: "torch.split", torch.Tensor.split: "torch.Tensor.split", torch.chunk: "torch.chunk",
          torch.Tensor.chunk: "torch.Tensor.chunk"}


def _cutter(func: Callable) -> Callable:
    """``split`` / ``chunk`` along a dim other than the items: local, each piece laid out as the input."""
    name = _NAMES[func]

    def rule(input: DomainTensor, how: Any, dim: int = 0) -> tuple[DomainTensor, ...]:
        spec = graph_spec_of(input)
        d = dim % input.ndim
        if d == spec.dim:
            refuse_item_loop(name, spec)
        pieces = func(unwrap(input), how, d)
        starts = [0, *itertools.accumulate(p.shape[d] for p in pieces)]
        return tuple(adopt(p, spec.replaced(endpoint=row_endpoint(spec, d, range(a, b))))
                     for p, a, b in zip(pieces, starts, starts[1:]))
    return rule


def _t(input: DomainTensor) -> DomainTensor:
    """``x.t()``: a 2-D graph tensor's dims swapped (a 1-D one as it is, as torch does)."""
    spec = graph_spec_of(input)
    if input.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {input.ndim}D")
    if input.ndim < 2:
        return adopt(unwrap(input).t(), spec)
    # NOTE: the (2, E) edge list transposed is (E, 2): its rows are no longer along dim 0, so no endpoint
    return adopt(unwrap(input).t(), spec.replaced(dim=1 - spec.dim, endpoint=None if spec.endpoint == -1 else spec.endpoint))


def _big_t(input: DomainTensor) -> DomainTensor:
    """``x.T``: every dim reversed (``t()`` for 2-D)."""
    spec = graph_spec_of(input)
    order = list(reversed(range(input.ndim)))
    moved = spec.endpoint == -1 and input.ndim > 1
    return adopt(unwrap(input).permute(order), spec.replaced(dim=order.index(spec.dim), endpoint=None if moved
                                                            else spec.endpoint))


for _funcs, _rule in (
    ((torch.unbind, torch.Tensor.unbind), _unbind),
    ((torch.t, torch.Tensor.t), _t), ((torch.Tensor.T.__get__,), _big_t),  # type: ignore[attr-defined]
):
    for _f in _funcs:
        GRAPH_RULES.register(_f, layout_rule()(_rule))  # NOTE: laid out from metadata alone: kept on one rank
for _f in (torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk):
    GRAPH_RULES.register(_f, layout_rule()(_cutter(_f)))
