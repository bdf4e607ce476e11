"""Aggregation over a graph's edges: ``index_add``, ``scatter_add`` and ``scatter_reduce`` (sum, mean, amax, amin,
prod) into node tensors.

Usage (through torch)::

    agg = x.new_zeros(x.shape).index_add_(0, dst, msg)                         # messages summed at their destinations
    agg = msg.new_zeros(n, f).scatter_add_(0, dst.view(-1, 1).expand_as(msg), msg)   # PyG's scatter
    top = msg.new_zeros(n, h).scatter_reduce_(0, idx, msg, "amax", include_self=False)  # segment max (softmax)
    back = x.new_zeros(x.shape).index_add_(0, src, msg)                        # to the sources: sums travel home

Edges are owned by their destination's rank, so aggregation at the destinations (an index that is row 1 of the edge
list) is local: every reduction, exact. Aggregation into the sources (or any index into another rank's nodes) adds
this rank's partial sums for its halo nodes and sends them to their owners (the adjoint of the gather): sums only.
A plain target (``torch.zeros(n)``, PyG's ``deg``) of one row per node becomes the node tensor it is written into.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import disable_torch_function_subclass, view_base
from mesh3d.domain.core.settings import refuse_while_traced, traced
from mesh3d.domain.core.specs import GraphSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.kept_steps import layout_rule
from mesh3d.domain.dispatch.registry import GRAPH_RULES
from mesh3d.domain.layouts.graph_halo import scatter_halo
from mesh3d.domain.ops.graph.common import graph_spec_of, is_graph, lookup, own_rows, rows_for
from mesh3d.graphs import Partition

__all__ = ["aggregate"]


def _refuse_index(op: str) -> None:
    raise NotImplementedError(
        f"{op}: the index of an aggregation over a graph must be a row of its edge list (domain.edge_index(graph)[1]), "
        "so each rank knows where its sums go. A graph-level readout (PyG's global_*_pool with a batch vector of one "
        "graph) is a reduction over the nodes: h.sum(0), h.mean(0) or h.amax(0), or the pool with batch=None")


def _target_nodes(target: torch.Tensor, dim: int, ispec: GraphSpec, op: str) -> Partition:
    graph = ispec.graph
    if graph is None:
        _refuse_index(op)
    if is_graph(target):
        tspec = graph_spec_of(target)
        if tspec.dim != dim or not graph.endpoints_in(tspec.items):
            raise ValueError(f"{op}: the target is laid out by {tspec.items} along dim {tspec.dim}, which is not a node "
                             f"partition of {graph!r} along dim {dim}")
        return tspec.items
    n = size_of(target)[dim]
    for k in ((1, 0) if ispec.endpoint != 0 else (0, 1)):
        nodes = graph.dst if k == 1 else graph.src
        if nodes.n == n:
            return nodes
    raise ValueError(f"{op}: a plain target of {n} rows along dim {dim} is not one row per node of {graph!r}; give it "
                     "one row per node (PyG's utilities: pass num_nodes=, or dim_size=), or write into a node tensor "
                     "(x.new_zeros(...))")


def _compact(index: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Size | None]:
    """A broadcast index (``idx.view(-1, 1).expand_as(src)``) as its 1-D column, to look up once; else as is."""
    if index.ndim > 1 and all(st == 0 for d, st in enumerate(index.stride()) if d != dim):
        return torch.as_strided(index, (index.shape[dim],), (index.stride(dim),)), index.shape
    return index, None


def _become(target: torch.Tensor, local: torch.Tensor, spec: GraphSpec, op: str) -> DomainTensor:
    """A plain target written in place turns into the node tensor it now is (its data: this rank's rows)."""
    with disable_torch_function_subclass():
        if target.requires_grad or view_base(target) is not None:
            raise NotImplementedError(f"{op} into a plain tensor that requires grad or is a view: write into a node "
                                      "tensor (x.new_zeros(x.shape)) instead")
        target.resize_(local.shape)
        target.copy_(local)
    target.__class__ = DomainTensor
    target._spec = spec  # type: ignore[attr-defined]  # re-classed on the line above
    return target


def aggregate(op: str, apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], target: Any,
              dim: int, index: DomainTensor, src: Any, inplace: bool, sums: bool) -> Any:
    """``apply(target rows, positions, src rows)`` (a torch scatter/index op on local tensors) over a graph's edges.

    Usage: ``aggregate("torch.Tensor.index_add_", lambda t, i, s: t.index_add_(0, i, s), out, 0, dst, msg, True, True)``
    ``sums``: the reduction is a sum (partial sums of another rank's nodes may travel home).
    """
    if not is_graph(index):  # NOTE: a plain index (the edge list itself, a batch vector) names no rank's rows
        _refuse_index(op)
    ispec = graph_spec_of(index)
    d = dim % (target.ndim if isinstance(target, torch.Tensor) else index.ndim)
    nodes = _target_nodes(target, d, ispec, op)
    comm, graph = ispec.comm, ispec.graph
    spec = GraphSpec(d, nodes, comm)
    plain = not isinstance(target, DomainTensor)
    if inplace and plain:  # NOTE: traced, a fake tensor cannot become a node tensor (Dynamo's internal assert)
        refuse_while_traced(op, "a plain tensor written in place by a graph index turns into a node tensor")
    if inplace and not plain and traced():
        # NOTE: traced, each read of a wrapper's shard is an alias of its own, and a write into one would not carry
        # its history to the target: the result is made out of place, and the dispatcher rebases the target onto it
        inplace = False
    rows = rows_for(target, d, spec, op) if plain else unwrap(target)
    src_rows = unwrap(src) if is_graph(src) else rows_for(src, d, ispec, op)
    if is_graph(src) and graph_spec_of(src).items != ispec.items:
        raise ValueError(f"{op}: the values are laid out as {graph_spec_of(src).items}, the index as {ispec.items}")
    idx, shape = _compact(unwrap(index), d)
    local = ispec.endpoint == 1 and nodes == graph.dst  # destinations: this rank's own nodes
    if local or sum(graph.halo_counts(nodes)) == 0:
        pos = own_rows(idx, nodes, comm, op)
        pos = pos if shape is None else pos.view([-1 if k == d else 1 for k in range(len(shape))]).expand(shape)
        if plain:
            out = apply(rows.clone() if rows is target else rows, pos, src_rows)
            return _become(target, out, spec, op) if inplace else adopt(out, spec)
        if inplace:
            apply(rows, pos, src_rows)  # NOTE: on the shard's alias: autograd rebases the domain tensor itself
            return target
        return adopt(apply(rows.clone(), pos, src_rows), spec)
    if not sums:
        raise NotImplementedError(f"{op} with a reduction other than a sum into nodes of other ranks (an index that "
                                  "is not the destinations of the edge list): only sums travel home; aggregate at the "
                                  "destinations, or reverse the edges")
    plan = graph.halo(nodes, comm.index)
    pos = lookup(idx, plan, comm, op)
    pos = pos if shape is None else pos.view([-1 if k == d else 1 for k in range(len(shape))]).expand(shape)
    ext_shape = list(rows.shape)
    ext_shape[d] = plan.own + plan.halo_rows
    partial = scatter_halo(apply(src_rows.new_zeros(ext_shape), pos, src_rows), d, plan, comm)
    if plain:
        return _become(target, rows + partial, spec, op) if inplace else adopt(rows + partial, spec)
    if inplace:
        rows.add_(partial)
        return target
    return adopt(rows + partial, spec)


def _scatter_add(inplace: bool) -> Callable:
    name = "torch.Tensor.scatter_add_" if inplace else "torch.scatter_add"

    def rule(input, dim, index, src):
        return aggregate(name, lambda t, i, s: t.scatter_add_(dim % t.ndim, i, s), input, dim, index, src, inplace, True)
    return rule


def _index_add(inplace: bool) -> Callable:
    name = "torch.Tensor.index_add_" if inplace else "torch.index_add"

    def rule(input, dim, index, source, *, alpha=1):
        return aggregate(name, lambda t, i, s: t.index_add_(dim % t.ndim, i, s, alpha=alpha), input, dim, index, source,
                         inplace, True)
    return rule


def _scatter_reduce(inplace: bool) -> Callable:
    name = "torch.Tensor.scatter_reduce_" if inplace else "torch.scatter_reduce"

    def rule(input, dim, index, src, reduce, *, include_self=True):
        apply = lambda t, i, s: t.scatter_reduce_(dim % t.ndim, i, s, reduce, include_self=include_self)
        return aggregate(f"{name}(reduce={reduce!r})", apply, input, dim, index, src, inplace, reduce == "sum")
    return rule


for _funcs, _make in (((torch.Tensor.scatter_add, torch.scatter_add), _scatter_add(False)),
                      ((torch.Tensor.scatter_add_,), _scatter_add(True)),
                      ((torch.Tensor.index_add, torch.index_add), _index_add(False)),
                      ((torch.Tensor.index_add_,), _index_add(True)),
                      ((torch.Tensor.scatter_reduce, torch.scatter_reduce), _scatter_reduce(False)),
                      ((torch.Tensor.scatter_reduce_,), _scatter_reduce(True))):
    for _f in _funcs:  # NOTE: a result laid out as the target, from metadata alone: kept on one rank (not a write)
        GRAPH_RULES.register(_f, _make if _f.__name__.endswith("_") else layout_rule()(_make))
