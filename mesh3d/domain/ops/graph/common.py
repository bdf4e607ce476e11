"""What the graph rules share: reading a graph spec, another operand's rows for this rank, index lookups.

Usage: ``spec = graph_spec_of(x); rows = rows_for(o, dim, spec, "torch.add"); pos = own_rows(idx, nodes, comm)``
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d.domain.core.specs import GraphSpec, Layout
from mesh3d.domain.core.tensor import DomainTensor, unwrap
from mesh3d.domain.layouts.graph_halo import entering
from mesh3d.graphs import HaloPlan, Partition

__all__ = ["VALUE_KEEPING", "graph_spec_of", "is_graph", "lookup", "own_rows", "rows_for", "sharded_at"]


def is_graph(t: Any) -> bool:
    return isinstance(t, DomainTensor) and t._spec.layout is Layout.GRAPH


def graph_spec_of(x: DomainTensor) -> GraphSpec:
    spec = x._spec
    assert isinstance(spec, GraphSpec)
    return spec


def sharded_at(o: torch.Tensor, ref: DomainTensor) -> int:
    """Where ``ref``'s sharded dim falls in ``o`` when the two broadcast (aligned from the last dim; < 0: not there)."""
    return o.ndim - (ref.ndim - graph_spec_of(ref).dim)


def rows_for(o: Any, dim: int, spec: GraphSpec, op: str) -> Any:
    """This rank's part of an operand meeting graph-laid-out ``spec`` items along ``dim`` of ``o``: a plain tensor of
    size 1 there as is, of the global item count indexed by this rank's items; a replicated value as is (its gradient
    summed over the domain); anything else refused.

    Usage: ``bias_rows = rows_for(bias, 0, x.spec, "torch.add")``
    """
    if not isinstance(o, torch.Tensor):
        return o
    if isinstance(o, DomainTensor):
        if o._spec.layout is not Layout.REPLICATED:
            raise ValueError(f"{op}: a graph tensor meets one laid out otherwise ({o._spec.layout.value}); lay both out "
                             "with the same graph partition (domain.shard_nodes / domain.edge_index)")
        return entering(unwrap(o), spec.comm)
    if dim < 0 or o.shape[dim] == 1:
        return o
    if o.shape[dim] == spec.items.n:  # one row per item, in global order: this rank's rows of it
        return o.index_select(dim, spec.items.tensor("items", spec.comm.index).to(o.device))
    raise ValueError(f"{op}: a tensor of shape {tuple(o.shape)} meets a graph tensor of {spec.items.n} items along dim "
                     f"{dim}; give it {spec.items.n} rows there (one per item, global order) or 1")


#: Element-wise functions that keep the values (so an index tensor stays the edge list row it was).
VALUE_KEEPING = {torch.Tensor.clone, torch.clone, torch.Tensor.contiguous, torch.Tensor.detach, torch.detach,
                 torch.Tensor.to, torch.Tensor.long, torch.Tensor.int, torch.Tensor.cpu, torch.Tensor.cuda}


def _index_values(idx: torch.Tensor, op: str) -> torch.Tensor:
    if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{op}: the index must hold integer node ids, got dtype {idx.dtype}")
    return idx.long()


_NOT_OWN = ("an index of the destinations names a node another rank owns; the edges of a graph layout are owned by "
            "their destination's rank (build the edge list with domain.edge_index)")


def own_rows(idx: torch.Tensor, nodes: Partition, me: int, op: str, not_own: str = _NOT_OWN) -> torch.Tensor:
    """This rank's rows of the nodes ``idx`` names (global ids it owns); raises ``not_own`` (after the op's name)
    where it names another rank's node.

    Usage: ``pos = own_rows(unwrap(dst), x.spec.items, comm.index, "torch.Tensor.index_add_")``
    """
    ids = _index_values(idx, op)
    if ids.numel():
        if int(ids.min()) < 0 or int(ids.max()) >= nodes.n:
            raise IndexError(f"{op}: node ids {int(ids.min())}..{int(ids.max())} outside 0..{nodes.n - 1}")
        if bool((nodes.tensor("owner").to(ids.device)[ids] != me).any()):
            raise ValueError(f"{op}: {not_own}")
    return nodes.tensor("local_index").to(ids.device)[ids]


def lookup(idx: torch.Tensor, plan: HaloPlan, op: str) -> torch.Tensor:
    """Rows of ``[own; halo]`` for the node ids ``idx``; raises where one is neither this rank's nor in its halo.

    Usage: ``ext.index_select(0, lookup(unwrap(src), plan, "torch.Tensor.index_select"))``
    """
    ids = _index_values(idx, op)
    table = plan.ext_index.to(ids.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= len(table)):
        raise IndexError(f"{op}: node ids {int(ids.min())}..{int(ids.max())} outside 0..{len(table) - 1}")
    pos = table[ids]
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"{op}: the index names a node that is neither this rank's nor in its halo (the sources of "
                         "its edges): index with the graph's own edge list (domain.edge_index), or gather the tensor "
                         "first (.full_tensor())")
    return pos
