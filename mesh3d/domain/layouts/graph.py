"""The graph layout: node (or edge) tensors split by a partition of any assignment, and an edge list laid out with
its nodes. Made here; their ops are ``mesh3d.domain.ops.graph``'s rules.

Usage::

    xs = shard_nodes(x, part)                # (N, F) or (B, N, F) (dim=1): this rank's nodes, ascending global ids
    ei = edge_index(graph)                   # (2, E) int64, global ids: this rank's edges (owned by their destination)
    es = shard_edges(edge_attr, graph)       # (E, F) edge features, laid out as the edges
    xs = nodes_from_local(rows, part)        # each rank read its own nodes: no communication
    xs = nodes_from_tokens(t)                # a token grid (lat x lon blocks flattened) as the grid's nodes: no copy
    t = tokens_from_nodes(xs, like=t)        # and back
    whole = graph_full_tensor(xs)            # every node in global order, replicated

A rank's rows are its items in ascending global order (``Partition.items``): the spec is the partition, and every
rank knows every rank's rows.
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import DomainSpec, GraphSpec, TokenSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap, wrap, wrap_anew
from mesh3d.domain.layouts.graph_halo import gather_all
from mesh3d.graphs import Graph, Partition, grid_block_partition

__all__ = ["edge_index", "graph_full_tensor", "graph_spec", "nodes_from_local", "nodes_from_tokens", "shard_edges",
           "shard_nodes", "tokens_from_nodes"]


def _check(op: str, part: Partition, comm: DomainComm) -> None:
    if not isinstance(part, Partition):
        raise TypeError(f"domain.{op}: expected a mesh3d.graphs.Partition, got {type(part).__name__}")
    if part.parts != comm.size:
        raise ValueError(f"domain.{op}: the partition has {part.parts} parts but the domain has {comm.size} ranks; "
                         f"partition for {comm.size} (e.g. graphs.sfc_partition(coords, {comm.size}))")


def _dim(op: str, dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"domain.{op}: dim={dim!r} is out of range for a {ndim}-D tensor")
    return dim % ndim


def graph_spec(items: Partition, comm: DomainComm, dim: int = 0, graph: Graph | None = None,
               endpoint: int | None = None) -> GraphSpec:
    """The spec of a tensor whose ``dim`` holds ``items`` (checked against the domain's size).

    Usage: ``spec = graph_spec(part, domain_comm(), dim=1)``
    """
    _check("graph_spec", items, comm)
    return GraphSpec(dim, items, comm, graph, endpoint)


def shard_nodes(x: torch.Tensor, items: Partition, comm: DomainComm, dim: int = 0, graph: Graph | None = None) -> DomainTensor:
    """This rank's items of ``x`` (whole on every rank) along ``dim`` (differentiable: ``x.grad`` gets this rank's rows).

    Usage: ``xs = shard_nodes(x, part, comm)``
    """
    _check("shard_nodes", items, comm)
    dim = _dim("shard_nodes", dim, x.ndim)
    if x.shape[dim] != items.n:
        raise ValueError(f"domain.shard_nodes: x has {x.shape[dim]} rows along dim {dim} but the partition has "
                         f"{items.n} items")
    local = x.index_select(dim, items.tensor("items", comm.index).to(x.device))
    return wrap(local, GraphSpec(dim, items, comm, graph))


def nodes_from_local(local: torch.Tensor, items: Partition, comm: DomainComm, dim: int = 0,
                     graph: Graph | None = None) -> DomainTensor:
    """A graph-laid-out tensor from this rank's rows (its items in ascending global order); no communication.

    Usage: ``xs = nodes_from_local(rows_read_here, part, comm)``
    """
    _check("nodes_from_local", items, comm)
    dim = _dim("nodes_from_local", dim, local.ndim)
    if local.shape[dim] != items.counts[comm.index]:
        raise ValueError(f"domain.nodes_from_local: this rank holds {local.shape[dim]} rows along dim {dim} but the "
                         f"partition gives it {items.counts[comm.index]} (its items, in ascending global order)")
    return wrap_anew(local, GraphSpec(dim, items, comm, graph))


def edge_index(graph: Graph, comm: DomainComm) -> DomainTensor:
    """The edge list ``(2, E)`` (int64, global node ids) as a domain tensor: this rank's edges.

    Usage: ``ei = edge_index(graph, comm); x[ei[0]]`` (a gather: the halo travels)
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"domain.edge_index: expected a mesh3d.graphs.Graph, got {type(graph).__name__}")
    _check("edge_index", graph.edges, comm)
    mine = torch.from_numpy(graph.edge_index[:, graph.edges.items(comm.index)])
    return wrap(mine, GraphSpec(1, graph.edges, comm, graph, -1))


def shard_edges(e: torch.Tensor, graph: Graph, comm: DomainComm, dim: int = 0) -> DomainTensor:
    """This rank's edges' rows of ``e`` (edge features, whole on every rank) along ``dim``.

    Usage: ``es = shard_edges(edge_attr, graph, comm)``
    """
    return shard_nodes(e, graph.edges, comm, dim, graph)


def nodes_from_tokens(t: DomainTensor) -> DomainTensor:
    """A token grid (the lat x lon blocks of a grid field flattened, no prefix) as the grid's nodes: the same rows,
    whose partition is ``graphs.grid_block_partition(t.spec.sizes)``; nothing moves.

    Usage: ``grid_nodes = nodes_from_tokens(field.flatten(2).transpose(1, 2))  # (B, H*W, C)``
    """
    spec = t._spec
    if not isinstance(spec, TokenSpec) or spec.prefix or spec.keys is not None:
        raise ValueError("domain.nodes_from_tokens: expects a token grid without prefix tokens (blocks flattened, "
                         "e.g. field.flatten(2).transpose(1, 2))")
    # NOTE: a block flattened row-major holds its points in ascending global row-major order: the partition's order
    return wrap(unwrap(t), GraphSpec(spec.token_dim, grid_block_partition(spec.sizes), spec.comm))


def tokens_from_nodes(x: DomainTensor, like: DomainTensor) -> DomainTensor:
    """Nodes of a grid partition (``nodes_from_tokens``'s) as the token grid ``like``; nothing moves.

    Usage: ``t = tokens_from_nodes(decoded, like=tokens); field = t.transpose(1, 2).reshape(b, c, h, w)``
    """
    spec, grid = x._spec, like._spec
    if not isinstance(spec, GraphSpec) or not isinstance(grid, TokenSpec) or spec.items != grid_block_partition(grid.sizes):
        raise ValueError("domain.tokens_from_nodes: x must be laid out by the grid partition of the token grid `like` "
                         "(graphs.grid_block_partition(like.spec.sizes))")
    return wrap(unwrap(x), grid.with_token_dim(spec.dim).with_prefix(0))


def graph_full_tensor(x: DomainTensor) -> DomainTensor:
    """Every item in global order on every domain rank, replicated (differentiable).

    Usage: ``whole = xs.full_tensor()``
    """
    spec = x._spec
    assert isinstance(spec, GraphSpec)
    return adopt(gather_all(unwrap(x), spec.dim, spec.items, spec.comm), DomainSpec.replicated(spec.comm))
