"""What the graph rules share: reading a graph spec, another operand's rows for this rank, index lookups.

Usage: ``spec = graph_spec_of(x); rows = rows_for(o, dim, spec, "torch.add"); pos = own_rows(idx, nodes, comm, op)``
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d.domain.comm.compiled_exchange import COMMS, comm_key
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.settings import traced
from mesh3d.domain.core.specs import GraphSpec, Layout
from mesh3d.domain.core.tensor import DomainTensor, unwrap
from mesh3d.domain.dispatch.executor import telling_peers_of_failure
from mesh3d.domain.layouts.graph_halo import entering
from mesh3d.graphs import HaloPlan, Partition
from mesh3d.graphs.compiled_tables import table as compiled_table

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


def own_rows(idx: torch.Tensor, nodes: Partition, comm: DomainComm, op: str, not_own: str = _NOT_OWN) -> torch.Tensor:
    """This rank's rows of the nodes ``idx`` names (global ids it owns); raises ``not_own`` (after the op's name)
    where it names another rank's node.

    Usage: ``pos = own_rows(unwrap(dst), x.spec.items, comm, "torch.Tensor.index_add_")``
    """
    ids = _index_values(idx, op)
    owner, local = nodes.tensor("owner").to(ids.device), nodes.tensor("local_index").to(ids.device)
    return _checked_rows(ids, local, owner, comm, op, not_own)


_NOT_HALO = ("the index names a node that is neither this rank's nor in its halo (the sources of its edges): index with "
             "the graph's own edge list (domain.edge_index), or gather the tensor first (.full_tensor())")


def lookup(idx: torch.Tensor, plan: HaloPlan, comm: DomainComm, op: str) -> torch.Tensor:
    """Rows of ``[own; halo]`` for the node ids ``idx``; raises where one is neither this rank's nor in its halo.

    Usage: ``ext.index_select(0, lookup(unwrap(src), plan, comm, "torch.Tensor.index_select"))``
    """
    ids = _index_values(idx, op)
    return _checked_rows(ids, compiled_table(plan.ext_index).to(ids.device), None, comm, op, _NOT_HALO)


def _checked_rows(ids: torch.Tensor, table: torch.Tensor, owner: torch.Tensor | None, comm: DomainComm, op: str,
                  refusal: str) -> torch.Tensor:
    if traced():  # NOTE: the ids are values, known only when the graph runs: checked there, by the op looking them up
        return graph_rows(ids, table, owner, op, refusal, comm_key(comm.axis, comm.ranks, comm.index, comm.mesh_epoch))
    return _rows(ids, table, owner, comm.index, op, refusal)


def _rows(ids: torch.Tensor, table: torch.Tensor, owner: torch.Tensor | None, me: int, op: str,
          refusal: str) -> torch.Tensor:
    """``table[ids]``, raising where an id is out of range, or (with ``owner``) owned by another rank than ``me``, or
    (without) looks up a negative row (not held here)."""
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= len(table):
            raise IndexError(f"{op}: node ids {low}..{high} outside 0..{len(table) - 1}")
        if owner is not None and bool((owner[ids] != me).any()):
            raise ValueError(f"{op}: {refusal}")
    pos = table[ids]
    if owner is None and pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"{op}: {refusal}")
    return pos


@torch.library.custom_op("mesh3d::graph_rows", mutates_args=())
def graph_rows(ids: torch.Tensor, table: torch.Tensor, owner: torch.Tensor | None, op: str, refusal: str,
               comm_id: int) -> torch.Tensor:
    """``_rows`` as one op of a compiled graph: node ids are values, known (and checked) only when the graph runs. A
    rank whose ids fail tells its domain peers before raising, as the dispatcher does in eager code."""
    comm = DomainComm(*COMMS[comm_id])
    # NOTE: table[ids] is a new tensor: no alias. Inside a compiled graph no dispatcher runs around the op: the
    # executor's telling_peers_of_failure tells the peers, as the dispatcher's call of it does in eager code.
    if comm.size == 1:
        return _rows(ids, table, owner, comm.index, op, refusal)
    return telling_peers_of_failure(comm, op, lambda: _rows(ids, table, owner, comm.index, op, refusal))


@graph_rows.register_fake
def _(ids, table, owner, op, refusal, comm_id):
    return ids.new_empty(ids.shape, dtype=torch.int64)
