"""Graphs on the domain axis (public face): node tensors split by a partition, an edge list laid out with them.

Usage::

    from mesh3d import domain, graphs
    part = graphs.sfc_partition(coords, parts=dm.mesh_shape["domain"])
    g = graphs.Graph(edge_index, part)
    xs = domain.shard_nodes(x, part)             # (N, F) -> this rank's nodes (dim=1 for (B, N, F))
    ei = domain.edge_index(g)                    # (2, E) global ids: this rank's edges (owned by their destination)
    y = model(xs, ei)                            # x[ei[0]], index_add_ / scatter_reduce to ei[1], PyG layers: unchanged
    y.full_tensor()                              # every node, global order

docs/domain.md, "Graphs and meshes".
"""

from __future__ import annotations

import torch

from mesh3d.domain.api import domain_comm
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.layouts import graph as layout
from mesh3d.graphs import Graph, Partition

__all__ = ["edge_index", "nodes_from_local", "nodes_from_tokens", "shard_edges", "shard_nodes", "tokens_from_nodes"]


def shard_nodes(x: torch.Tensor, partition: Partition, dim: int = 0) -> DomainTensor:
    """This rank's nodes of ``x`` (whole on every rank) along ``dim``: its items of ``partition``, ascending.

    Usage: ``xs = domain.shard_nodes(x, part)``; batched ``(B, N, F)``: ``dim=1``
    """
    return layout.shard_nodes(x, partition, domain_comm(), dim)


def nodes_from_local(local: torch.Tensor, partition: Partition, dim: int = 0) -> DomainTensor:
    """This rank's nodes, read here (``partition.items(rank)``, ascending), as a graph tensor; no communication.

    Usage: ``xs = domain.nodes_from_local(rows, part)``
    """
    return layout.nodes_from_local(local, partition, domain_comm(), dim)


def edge_index(graph: Graph) -> DomainTensor:
    """The graph's ``(2, E)`` edge list (int64, global node ids) laid out with its nodes: this rank's edges.

    Usage: ``ei = domain.edge_index(g); src, dst = ei[0], ei[1]``
    """
    return layout.edge_index(graph, domain_comm())


def shard_edges(e: torch.Tensor, graph: Graph, dim: int = 0) -> DomainTensor:
    """This rank's edges' rows of the edge features ``e`` (whole on every rank), laid out as ``edge_index(graph)``.

    Usage: ``es = domain.shard_edges(edge_attr, g)``
    """
    return layout.shard_edges(e, graph, domain_comm(), dim)


nodes_from_tokens = layout.nodes_from_tokens
tokens_from_nodes = layout.tokens_from_nodes
