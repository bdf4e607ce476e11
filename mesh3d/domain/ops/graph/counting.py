"""Counting over a graph's items: ``bincount`` (degrees), ``unique``, and ``nonzero`` / one-argument ``where``; each
gives the one-process answer.

Usage (through torch)::

    deg_in = torch.bincount(dst, minlength=n)          # one entry per node: a node tensor, local (edges live at dst)
    deg_out = torch.bincount(src, weights=w)           # by sources: halo nodes' partial counts are sent home
    hist = torch.bincount(labels)                      # any other length: the whole result, replicated
    ids, inv, cnt = torch.unique(src, return_inverse=True, return_counts=True)   # replicated ids and counts
    (kept,) = torch.where(src != dst)                  # global edge positions, on the kept edges' owners
    loops = torch.where(src == dst, w, 2 * w)          # three arguments: element by element (pointwise's rule)

``bincount``'s one-process length is ``max(minlength, largest id + 1)``: one all-reduce of one int finds it unless
``minlength`` is at least the node count of the row's partition. When it equals the node count of the graph's source
(``endpoint`` 0) or destination (1) partition, the result is laid out by that partition.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mesh3d.domain.core.settings import refuse_while_traced
from mesh3d.domain.core.specs import DomainSpec, GraphSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.registry import GRAPH_RULES
from mesh3d.domain.dispatch.step import Partial, Step
from mesh3d.domain.layouts.graph_halo import entering, gather_varying, global_mask, reduce_sum, scatter_halo
from mesh3d.domain.ops.graph.common import graph_spec_of, is_graph, lookup, own_rows
from mesh3d.domain.ops.graph.pointwise import elementwise_rule
from mesh3d.graphs import Partition

__all__ = ["bincount", "nonzero_positions", "unique"]


def _node_partition(spec: GraphSpec) -> Partition | None:
    """The node partition a row of the edge list indexes (sources or destinations), None for any other tensor."""
    if spec.graph is None or spec.endpoint not in (0, 1):
        return None
    return spec.graph.dst if spec.endpoint == 1 else spec.graph.src


def _weights_rows(weights: Any, spec: GraphSpec, op: str) -> torch.Tensor | None:
    """This rank's weights: a graph tensor laid out like the index, or one entry per item (global order)."""
    if weights is None:
        return None
    if is_graph(weights):
        if graph_spec_of(weights).items != spec.items or weights.ndim != 1:
            raise ValueError(f"{op}: the weights must be 1-D and laid out like the index ({spec.items}), got "
                             f"{graph_spec_of(weights).items} in {weights.ndim}-D")
        return unwrap(weights)
    if isinstance(weights, DomainTensor):  # replicated: every item's weight on every rank
        weights = entering(unwrap(weights), spec.comm)
    if weights.ndim != 1 or weights.shape[0] != spec.items.n:
        raise ValueError(f"{op}: plain weights of shape {tuple(weights.shape)} for an index of {spec.items.n} items: "
                         f"give one weight per item in global order ({spec.items.n},), or a graph tensor laid out like "
                         "the index")
    return weights.index_select(0, spec.items.tensor("items", spec.comm.index).to(weights.device))


def _counts(idx: torch.Tensor, w: torch.Tensor | None, length: int, dtype: torch.dtype) -> torch.Tensor:
    """torch's bincount of this rank's part, in the dtype of the one-process result (torch gives int64 counts for an
    empty input even with float weights: a rank without items must not)."""
    out = torch.bincount(idx, w, minlength=length)
    return out if out.dtype == dtype else out.to(dtype)


def _largest(ids: torch.Tensor) -> torch.Tensor:
    return torch.tensor([int(ids.max()) if ids.numel() else -1], dtype=torch.int64)


def bincount(input: Any, weights: Any = None, minlength: int = 0) -> DomainTensor:
    """``torch.bincount(input, weights, minlength)`` of a 1-D integer graph tensor: a node tensor when the result has
    one entry per node of the partition a row of the edge list indexes, else the whole result, replicated.

    Usage: ``deg = bincount(ei[1], minlength=n)``
    """
    op = "torch.bincount"
    if not is_graph(input):
        raise NotImplementedError(f"{op} of a plain index with graph-laid-out weights: give the index as a graph "
                                  "tensor laid out like the weights (a row of domain.edge_index(graph))")
    spec = graph_spec_of(input)
    comm, me, local = spec.comm, spec.comm.index, unwrap(input)
    if input.ndim != 1 or local.dtype.is_floating_point or local.dtype.is_complex or local.dtype == torch.bool:
        raise RuntimeError(f"{op}: bincount only supports 1-d non-negative integral inputs (got a {input.ndim}-D "
                           f"{local.dtype} graph tensor)")
    refuse_while_traced(op, "its length and its check read the ids")
    if local.numel() and int(local.min()) < 0:
        raise RuntimeError(f"{op}: bincount only supports 1-d non-negative integral inputs (found {int(local.min())})")
    w = _weights_rows(weights, spec, op)
    dtype = torch.bincount(torch.zeros(1, dtype=torch.int64), None if w is None else w.new_zeros(1)).dtype \
        if spec.items.n else torch.int64
    nodes = _node_partition(spec)
    if nodes is not None and minlength >= nodes.n:
        length = int(minlength)
    else:  # the largest id over every rank: one int each, combined by the executor
        top = run_step(Step(_largest, (local,), partial=Partial("max", over=comm)))
        length = max(int(minlength), int(top[0]) + 1)
    if nodes is None or length != nodes.n:
        return adopt(reduce_sum(_counts(local, w, length, dtype), comm), DomainSpec.replicated(comm))
    graph = spec.graph
    assert graph is not None
    out = GraphSpec(0, nodes, comm)
    if spec.endpoint == 1 and nodes == graph.dst:  # the destinations: this rank's own nodes, nothing travels
        return adopt(_counts(own_rows(local, nodes, comm, op), w, nodes.counts[me], dtype), out)
    plan = graph.halo(nodes, me)  # the sources: counts of halo nodes are partial, sent home and added (index_add's)
    ext = _counts(lookup(local, plan, comm, op), w, plan.own + plan.halo_rows, dtype)
    return adopt(scatter_halo(ext, 0, plan, comm), out)


def _packed(values: torch.Tensor) -> torch.dtype:
    """The dtype one message carries a rank's unique values and their counts in, exactly."""
    if values.dtype.is_complex:
        raise NotImplementedError("torch.unique of a complex graph tensor: not supported; call .full_tensor() first")
    return torch.float64 if values.dtype.is_floating_point else torch.int64


def unique(input: DomainTensor, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False,
           dim: int | None = None) -> Any:
    """``torch.unique`` over every element of a graph tensor: the sorted union of every rank's values (replicated),
    their counts summed over the ranks (replicated), the inverse laid out like ``input``. One gather of each rank's
    own unique values and counts (after one int per rank: their number).

    Usage: ``ids, inv = unique(ei[0], return_inverse=True)``
    """
    op = "torch.unique"
    refuse_while_traced(op, "its length is the number of distinct values")
    spec = graph_spec_of(input)
    if dim is not None:
        raise NotImplementedError(f"{op}(dim={dim}) of a graph tensor: unique slices compare whole rows across the "
                                  "ranks; call it without dim (over every element) or on .full_tensor()")
    # NOTE: sorted=False leaves the order to torch; its CPU and CUDA kernels sort anyway, and so does this rule
    local = unwrap(input).detach()
    mine, inverse, counts = torch.unique(local, sorted=True, return_inverse=True, return_counts=True)
    pack = _packed(mine)
    parts = gather_varying(torch.cat([mine.to(pack), counts.to(pack)]), spec.comm)
    values = torch.cat([p[:len(p) // 2] for p in parts])
    every, where = torch.unique(values, sorted=True, return_inverse=True)
    start = sum(len(p) // 2 for p in parts[:spec.comm.index])
    rep = DomainSpec.replicated(spec.comm)
    out = [adopt(every.to(local.dtype), rep)]
    if return_inverse:
        out.append(adopt(where[start:start + len(mine)][inverse], spec.replaced(endpoint=None)))
    if return_counts:
        summed = torch.zeros(len(every), dtype=torch.int64, device=local.device)
        summed.index_add_(0, where, torch.cat([p[len(p) // 2:] for p in parts]).to(torch.int64))
        out.append(adopt(summed, rep))
    return out[0] if len(out) == 1 else tuple(out)


def nonzero_positions(mask: DomainTensor, op: str) -> DomainTensor:
    """The global positions of the nonzero items of a 1-D graph tensor (``torch.where(mask)[0]`` in one process), laid
    out on the kept items' owners (the partition of ``x[mask]``): one bit per item travels, as for a mask.

    Usage: ``kept = nonzero_positions(src != dst, "torch.where")  # kept.full_tensor(): every position, in order``
    """
    spec = graph_spec_of(mask)
    if mask.ndim != 1:
        raise NotImplementedError(f"{op} of a {mask.ndim}-D graph tensor: only a 1-D mask over the items (an edge or "
                                  "node mask) gives its global positions here; reduce it to one value per item first "
                                  "(mask.any(-1)), or call .full_tensor()")
    local = (unwrap(mask).detach() != 0).cpu()
    kept = spec.items.take(global_mask(local, spec.items, spec.comm))
    mine = spec.items.items(spec.comm.index)[local.numpy().astype(bool)]
    positions = torch.from_numpy(np.ascontiguousarray(mine, dtype=np.int64)).to(unwrap(mask).device)
    return adopt(positions, GraphSpec(0, kept, spec.comm))


_where_elementwise = elementwise_rule(torch.where)


def _where(condition: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:  # where(condition, x, y): element by element
        return _where_elementwise(condition, *args, **kwargs)
    return (nonzero_positions(condition, "torch.where(condition)"),)


def _nonzero(func: Any) -> Any:
    argwhere = func in (torch.argwhere, torch.Tensor.argwhere)
    name = "torch.argwhere" if argwhere else "torch.nonzero"

    def rule(input: DomainTensor, *, as_tuple: bool = False) -> Any:
        positions = nonzero_positions(input, name)
        if as_tuple and not argwhere:
            return (positions,)
        return adopt(unwrap(positions).unsqueeze(1), graph_spec_of(positions))
    return rule


for _f in (torch.bincount, torch.Tensor.bincount):
    GRAPH_RULES.register(_f, bincount)
for _f in (torch.unique, torch.Tensor.unique):
    GRAPH_RULES.register(_f, unique)
GRAPH_RULES.register(torch.where, _where)
for _f in (torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere):
    GRAPH_RULES.register(_f, _nonzero(_f))
