"""Graph rules that read other ranks' rows or make new layouts: the gather ``x[src]`` / ``index_select`` (halo rows
travel), rows of the edge list, boolean masks over items, ``cat`` along the items, and the ``new_*`` factories.

Usage (through torch)::

    src, dst = ei[0], ei[1]                 # rows of the edge list: each knows which it is
    xj = x[src]                              # x.index_select(0, src): only the halo travels; backward sums it home
    xi = x.index_select(0, dst)              # destinations are this rank's nodes: nothing travels
    kept = ei[:, src != dst]                 # a mask over the items: one bit per edge travels, a new layout
    ei = torch.cat([kept, loops], 1)         # a plain (2, N) piece is laid out as the destination nodes
    out = msg.new_zeros(n, f)                # n nodes: laid out as the destinations (the target of a scatter)
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.kept_steps import layout_rule
from mesh3d.domain.dispatch.registry import GRAPH_RULES
from mesh3d.domain.layouts.graph_halo import gather_halo, global_mask, shared_mask
from mesh3d.domain.ops.graph.common import graph_spec_of, is_graph, lookup, own_rows, rows_for
from mesh3d.domain.ops.graph.pieces import row_endpoint
from mesh3d.graphs import Partition

__all__ = ["gather_nodes", "take_own", "target_items"]


def gather_nodes(x: DomainTensor, dim: int, index: DomainTensor, op: str) -> DomainTensor:
    """``x.index_select(dim, index)``: ``x`` laid out by a node partition along ``dim``, ``index`` global node ids
    laid out with a graph's edges. Reads only this rank's rows and its halo.

    Usage: ``xj = gather_nodes(x, 0, ei_src, "torch.Tensor.index_select")``
    """
    spec, ispec = graph_spec_of(x), graph_spec_of(index)
    graph, comm = ispec.graph, spec.comm
    if spec.dim != dim % x.ndim:
        raise NotImplementedError(f"{op} along dim {dim} of a graph tensor whose items are along dim {spec.dim}")
    if graph is None and ispec.endpoint is None and index.ndim == 1 and not index.dtype.is_floating_point:
        return take_own(x, spec.dim, index, op)
    if graph is None or index.ndim != 1:
        raise NotImplementedError(f"{op}: the index of a graph gather must be a row of a graph's edge list (1-D, e.g. "
                                  "ei[0] with ei = domain.edge_index(graph)), so each rank knows the halo it reads")
    if not graph.endpoints_in(spec.items):
        raise ValueError(f"{op}: the index names nodes of {graph!r}, but the tensor is laid out by {spec.items}: "
                         "neither the graph's source nor its destination partition")
    if ispec.endpoint == 1 and spec.items == graph.dst:  # destinations: this rank's own nodes
        rows = unwrap(x).index_select(spec.dim, own_rows(unwrap(index), spec.items, comm, op))
    else:
        plan = graph.halo(spec.items, comm.index)
        ext = gather_halo(unwrap(x), spec.dim, plan, comm)
        rows = ext.index_select(spec.dim, lookup(unwrap(index), plan, comm, op))
    return adopt(rows, spec.replaced(items=ispec.items, graph=graph, endpoint=None))


_NOT_OWN = ("an index of item positions names an item another rank owns; a gather by positions (torch.where(mask)[0], "
            "x.nonzero()) reads only this rank's items: index the tensor the mask was over, or call .full_tensor()")


def take_own(x: DomainTensor, dim: int, index: DomainTensor, op: str) -> DomainTensor:
    """``x`` indexed along its item dim ``dim`` by global item positions that each rank holds for its own items
    (``torch.where(mask)[0]`` of a mask over ``x``'s items): local rows, laid out as ``index``; raises where a position
    names another rank's item.

    Usage: ``kept_attr = take_own(edge_attr, 0, torch.where(keep)[0], "torch.Tensor.__getitem__")``
    """
    spec, ispec = graph_spec_of(x), graph_spec_of(index)
    rows = own_rows(unwrap(index), spec.items, spec.comm, op, _NOT_OWN)
    return adopt(unwrap(x).index_select(dim, rows), spec.replaced(items=ispec.items))


def _table_rows(table: torch.Tensor, dim: int, index: DomainTensor, op: str) -> DomainTensor:
    """Rows of a plain (or replicated) table of every node, by the global ids of a graph index: each rank takes the
    rows its items name (a replicated table's gradient is summed over the domain)."""
    ispec = graph_spec_of(index)
    if index.ndim != 1:
        raise NotImplementedError(f"{op}: a graph index must be 1-D (a row of the edge list)")
    plain = rows_for(table, -1, ispec, op)  # a replicated value entering, or the plain table as is
    d = dim % table.ndim
    return adopt(plain.index_select(d, unwrap(index).long()), ispec.replaced(dim=d, endpoint=None))


def _index_select(input, dim, index):
    if is_graph(index):
        if is_graph(input):
            return gather_nodes(input, dim, index, "torch.index_select")
        return _table_rows(input, dim, index, "torch.index_select")
    spec = graph_spec_of(input)
    if isinstance(index, DomainTensor) or dim % input.ndim == spec.dim:
        raise NotImplementedError("torch.index_select along the item dim of a graph tensor with a plain index: index "
                                  "with a row of the graph's edge list (domain.edge_index), or call .full_tensor()")
    return adopt(unwrap(input).index_select(dim, index), spec)


def _mask_items(x: DomainTensor, dim: int, mask: DomainTensor) -> DomainTensor:
    spec, mspec = graph_spec_of(x), graph_spec_of(mask)
    if mask.ndim != 1 or mspec.items != spec.items:
        raise NotImplementedError("a boolean mask over a graph tensor's items must be 1-D and laid out as its items")
    return _kept(x, dim, unwrap(mask), global_mask(unwrap(mask), spec.items, spec.comm))


def _kept(x: DomainTensor, dim: int, mine: torch.Tensor, keep) -> DomainTensor:
    """``x``'s items where ``mine`` (this rank's bits) holds, laid out as the items where ``keep`` (every bit) holds."""
    spec = graph_spec_of(x)
    return adopt(unwrap(x)[(slice(None),) * dim + (mine,)], spec.replaced(items=spec.items.take(keep)))


def _plain_mask_items(x: DomainTensor, dim: int, mask: torch.Tensor) -> DomainTensor:
    """``x`` masked along its items by a plain bool mask over all of them, drawn alike on every rank (PyG's
    ``dropout_edge``: ``edge_index[:, torch.rand(E) >= p]``): each rank keeps its items' bits of it."""
    spec = graph_spec_of(x)
    if mask.ndim != 1 or mask.numel() != spec.items.n:
        raise NotImplementedError(f"a plain boolean mask over a graph tensor's items must be 1-D with one bit per item "
                                  f"({spec.items.n}), got shape {tuple(mask.shape)}")
    keep = shared_mask(mask, spec.comm)
    if keep is None:
        raise ValueError("a plain boolean mask over a graph tensor's items differs between the domain's ranks (drawn "
                         "from streams that differ): draw it after dm.manual_seed(seed), which every rank of the domain "
                         "shares, or make it a graph tensor laid out as the items (e.g. from src != dst)")
    return _kept(x, dim, torch.from_numpy(keep[spec.items.items(spec.comm.index)]).to(unwrap(x).device), keep)


_WHOLE = slice(None)


def _refuse_index(spec, index) -> None:
    raise NotImplementedError(f"indexing a graph tensor (items along dim {spec.dim}) with {index!r}: supported are a "
                              "gather x[idx] by a row of the edge list, a boolean mask over the items (a graph tensor, "
                              "or plain with one bit per item, alike on every rank), and ints, "
                              "slices and None on the other dims (the item dim taken whole, ':')")


def _getitem(self, index):
    items = list(index) if isinstance(index, tuple) else [index]
    gather = len(items) == 1 and is_graph(items[0]) and items[0].dtype != torch.bool
    if not is_graph(self):
        if gather:
            return _table_rows(self, 0, items[0], "torch.Tensor.__getitem__")
        raise NotImplementedError("indexing a tensor with a graph index: x[idx] with idx a row of a graph's edge list")
    spec = graph_spec_of(self)
    if gather:
        return gather_nodes(self, 0, items[0], "torch.Tensor.__getitem__")
    if any(i is Ellipsis for i in items):
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        items[at:at + 1] = [_WHOLE] * (self.ndim - sum(i is not None and i is not Ellipsis for i in items))
    dim = out = 0
    picked = None
    for k, item in enumerate(items):
        if item is None:
            out += 1
            continue
        if dim == spec.dim:
            if is_graph(item) and item.ndim == 1 and (item.dtype == torch.bool or graph_spec_of(item).graph is None):
                if any(i is not _WHOLE and i != _WHOLE for i in items[:k] + items[k + 1:]):
                    _refuse_index(spec, index)
                if item.dtype == torch.bool:
                    return _mask_items(self, dim, item)
                return take_own(self, dim, item, "torch.Tensor.__getitem__")  # ei[:, torch.where(keep)[0]]
            if isinstance(item, torch.Tensor) and not is_graph(item) and item.dtype == torch.bool:
                if any(i is not _WHOLE and i != _WHOLE for i in items[:k] + items[k + 1:]):
                    _refuse_index(spec, index)
                return _plain_mask_items(self, dim, item)  # ei[:, torch.rand(E) >= p]: dropout_edge
            if not (isinstance(item, slice) and item == _WHOLE):
                _refuse_index(spec, index)
            picked = out
        elif isinstance(item, torch.Tensor):
            _refuse_index(spec, index)
        out += 0 if isinstance(item, int) else 1
        dim += 1
    picked = out + (spec.dim - dim) if picked is None else picked
    return adopt(unwrap(self)[tuple(items)], spec.replaced(dim=picked, endpoint=_endpoint_after(spec, items)))


def _endpoint_after(spec, items: list) -> int | None:
    """The endpoint of ``x[items]``: for the ``(2, E)`` edge list, row k's for ``ei[k]`` and ``ei[k:k + 1]``, -1 for
    it whole, None for anything else (no row); any other tensor's own."""
    if spec.endpoint != -1:
        return spec.endpoint
    first = items[0] if items else _WHOLE
    if isinstance(first, slice) and first == _WHOLE:
        return -1
    if spec.dim != 1:
        return None
    if isinstance(first, int):
        return first % 2
    return row_endpoint(spec, 0, range(2)[first]) if isinstance(first, slice) else None


def _select(input, dim, index):
    return _getitem(input, (_WHOLE,) * (dim % input.ndim) + (index,))


def target_items(like: DomainTensor, length: int) -> tuple[Partition, Any] | None:
    """The partition of a new tensor of ``length`` items made from ``like`` (a graph tensor): ``like``'s own items,
    else its graph's destination (then source) nodes; None when none has that many.

    Usage: ``found = target_items(msg, n_nodes)  # (partition, graph or None)``
    """
    spec = graph_spec_of(like)
    if length == spec.items.n:
        return spec.items, spec.graph
    graph = spec.graph
    if graph is not None:
        for nodes in (graph.dst, graph.src):
            if length == nodes.n:
                return nodes, None
    return None


def _factory(make, fill: bool):
    def rule(self, *size, **kwargs):
        args: tuple = ()
        if fill:  # new_full(size, fill_value)
            size, args = size[:1], size[1:]
        spec = graph_spec_of(self)
        if "size" in kwargs:
            size = (kwargs.pop("size"),)
        shape = [int(s) for s in (size[0] if len(size) == 1 and not isinstance(size[0], int) else size)]
        at = spec.dim if len(shape) == self.ndim else 0 if len(shape) == 1 else None
        found = target_items(self, shape[at]) if at is not None and shape else None
        if found is None:  # not a tensor of these items: a plain tensor, whole on every rank
            return make(unwrap(self), shape, *args, **kwargs)
        items, graph = found
        shape[at] = items.counts[spec.comm.index]
        return adopt(make(unwrap(self), shape, *args, **kwargs),
                     spec.replaced(dim=at, items=items, graph=graph, endpoint=None))
    return rule


def _laid_out(piece: Any, dim: int, ref: DomainTensor, op: str) -> tuple[torch.Tensor, Partition]:
    """A piece of a ``cat`` along the items: its rows here and its partition (a plain piece of as many rows as the
    graph has destination nodes is laid out as those nodes: a self-loop per node)."""
    if is_graph(piece):
        return unwrap(piece), graph_spec_of(piece).items
    spec = graph_spec_of(ref)
    found = target_items(ref, size_of(piece)[dim]) if spec.graph is not None else None
    if found is None or isinstance(piece, DomainTensor):
        raise NotImplementedError(f"{op} along the item dim: a piece of {size_of(piece)[dim]} rows is neither laid out "
                                  "by a graph partition nor one row per destination node of the graph")
    items = found[0]
    return rows_for(piece, dim, spec.replaced(items=items), op), items


def _cat(tensors, dim=0):
    ref = next(t for t in tensors if is_graph(t))
    spec = graph_spec_of(ref)
    d = dim % ref.ndim
    if d != spec.dim:
        locals_ = [unwrap(t) if is_graph(t) else rows_for(t, spec.dim, spec, "torch.cat") for t in tensors]
        for t in tensors:
            if is_graph(t) and graph_spec_of(t).items != spec.items:
                raise ValueError("torch.cat of graph tensors laid out differently (along a feature dim)")
        return adopt(torch.cat(locals_, d), spec.replaced(endpoint=None))
    pieces = [_laid_out(t, d, ref, "torch.cat") for t in tensors]
    items = Partition.concat([p for _, p in pieces])
    endpoints = {graph_spec_of(t).endpoint for t in tensors if is_graph(t)}
    return adopt(torch.cat([p for p, _ in pieces], d),
                 spec.replaced(items=items, endpoint=endpoints.pop() if len(endpoints) == 1 else None))


def _stack(tensors, dim=0):
    ref = next(t for t in tensors if is_graph(t))
    spec = graph_spec_of(ref)
    if any(not is_graph(t) or graph_spec_of(t).items != spec.items or t.ndim != ref.ndim for t in tensors):
        raise NotImplementedError("torch.stack on a graph layout: every piece a graph tensor of the same items")
    d = dim % (ref.ndim + 1)
    return adopt(torch.stack([unwrap(t) for t in tensors], d), spec.replaced(dim=spec.dim + (d <= spec.dim), endpoint=None))


def _as_local_plain(func):
    def rule(input, *args, **kwargs):  # ``numpy()`` and friends: refused (the local values are not the whole)
        raise NotImplementedError(f"{func.__name__} of a graph tensor: it holds this rank's items only; call "
                                  ".full_tensor() first")
    return rule


def _setitem(target, key, value):
    raise NotImplementedError(
        "torch.Tensor.__setitem__ into or from a graph tensor (nodes or edges split by a partition): positions along "
        "the items name different items on each rank, so a write by position would not be the one-process write. "
        "Aggregate into node tensors with a row of the edge list (index_add_, scatter_add_, scatter_reduce); edit the "
        "edge list itself (PyG's to_undirected and coalesce write into it) before building the graph, on the whole "
        "edge list: graphs.Graph(to_undirected(edge_index), part); or call .full_tensor() first")


def _not_a_mask(self, index) -> bool:
    """Whether ``x[index]`` takes no boolean mask (whose kept items follow from its values)."""
    return not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                   for i in (index if isinstance(index, tuple) else (index,)))


# NOTE: a gather, a row, a selection, a cat (of its pieces' partitions) and a factory lay their results out from
# metadata alone (kept on one rank); a mask's items follow from its values
for _funcs, _rule in (
    ((torch.Tensor.__setitem__,), _setitem),
    ((torch.index_select, torch.Tensor.index_select), layout_rule()(_index_select)),
    ((torch.Tensor.__getitem__,), layout_rule(_not_a_mask)(_getitem)),
    ((torch.select, torch.Tensor.select), layout_rule()(_select)),
    ((torch.cat, torch.concat, torch.concatenate), layout_rule()(_cat)), ((torch.stack,), layout_rule()(_stack)),
    ((torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item), None),
):
    for _f in _funcs:
        GRAPH_RULES.register(_f, _rule if _rule is not None else _as_local_plain(_f))
for _f in (torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full):
    GRAPH_RULES.register(_f, layout_rule()(_factory(_f, _f is torch.Tensor.new_full)))
