"""A graph's edges laid out with its nodes, and the halo each rank receives: planned from the partitions alone.

Usage::

    g = Graph(edge_index, nodes)                    # (2, E) global ids; src == dst node set
    g = Graph(edge_index, grid_part, mesh_part)     # bipartite: sources on the grid, destinations on the mesh
    g.edges                                          # the edges' Partition: each edge on its destination's rank
    g.halo_counts(nodes)                             # per rank: rows it receives when it reads ``nodes`` by its edges
    plan = g.halo(nodes, rank)                       # what ``rank`` sends, receives, and where each node lands

Edges are owned by their destination's rank, so aggregation to destinations (scatter, index_add, segment softmax)
reads only this rank's rows; reading the sources (``x[src]``) needs the *halo*: the source nodes of this rank's edges
that other ranks own. Every rank knows the whole edge list and both partitions, so every rank plans every exchange
without asking its peers, and the count here is what the exchange sends (tests hold one to the other).
No process group here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mesh3d._torch_private import outside_dispatch_modes
from mesh3d.graphs.partition import Partition

__all__ = ["Graph", "HaloPlan"]


@dataclass(frozen=True)
class HaloPlan:
    """Rank ``me``'s halo for one node partition: rows it receives (``recv``: (peer, count) in peer order, ids in
    ``halo_ids``), rows it sends (``send``: (peer, local rows)), and ``ext_index``: each global node's row in
    ``[own rows; received rows]`` (-1: not there).

    Usage: ``ext = torch.cat([own, *received]); rows = ext[plan.ext_index[idx]]``
    """

    me: int
    own: int
    recv: tuple[tuple[int, int], ...]
    send: tuple[tuple[int, torch.Tensor], ...]
    halo_ids: np.ndarray
    ext_index: torch.Tensor

    @property
    def halo_rows(self) -> int:
        """Rows received."""
        return sum(n for _, n in self.recv)

    @property
    def moves_nothing(self) -> bool:
        return not self.recv and not self.send


class Graph:
    """Directed edges ``(2, E)`` (global ids: row 0 sources, row 1 destinations) between the nodes of ``src`` and
    ``dst`` (the same partition for a graph on one node set); the edges are owned by their destination's rank.

    Usage: ``g = Graph(edge_index, part); g.edges.counts; g.halo_counts(part)``

    Two graphs are the same graph only if they are the same object (a domain tensor's spec names its graph).
    """

    def __init__(self, edge_index: np.ndarray | torch.Tensor, src: Partition, dst: Partition | None = None) -> None:
        dst = src if dst is None else dst
        if isinstance(edge_index, torch.Tensor):
            edge_index = edge_index.detach().cpu().numpy()
        edges = np.asarray(edge_index)
        if edges.ndim != 2 or edges.shape[0] != 2 or (edges.size and not np.issubdtype(edges.dtype, np.integer)):
            raise ValueError(f"Graph: edge_index must be a (2, E) integer array of global node ids, got shape "
                             f"{edges.shape} dtype {edges.dtype}")
        if not isinstance(src, Partition) or not isinstance(dst, Partition) or src.parts != dst.parts:
            raise ValueError("Graph: src and dst must be Partitions over the same number of ranks")
        for row, part, name in ((0, src, "sources"), (1, dst, "destinations")):
            if edges.shape[1] and (edges[row].min() < 0 or edges[row].max() >= part.n):
                raise ValueError(f"Graph: edge {name} must lie in 0..{part.n - 1} (the node count of their partition); "
                                 f"got {int(edges[row].min())}..{int(edges[row].max())}")
        self.edge_index = edges.astype(np.int64)
        self.edge_index.setflags(write=False)
        self.src, self.dst = src, dst
        self.parts = src.parts
        self.edges = Partition(dst.owner[self.edge_index[1]], self.parts)
        self._halos: dict[Partition, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._plans: dict[tuple[Partition, int], HaloPlan] = {}

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])

    def __repr__(self) -> str:
        return f"Graph(edges={self.num_edges}, src={self.src}, dst={self.dst})"

    def __deepcopy__(self, memo: dict) -> Graph:
        return self  # immutable; a spec naming it stays the same graph

    def endpoints_in(self, nodes: Partition) -> tuple[int, ...]:
        """The rows of the edge list whose ids index ``nodes`` (0: sources, 1: destinations); () when neither.

        Usage: ``if not g.endpoints_in(x_part): raise ...``
        """
        return tuple(k for k, p in ((0, self.src), (1, self.dst)) if p == nodes)

    def _all_halos(self, nodes: Partition) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (reader, holder, node id) of the halo, sorted by reader, holder, id: O(E log E) once per partition."""
        hit = self._halos.get(nodes)
        if hit is not None:
            return hit
        rows = self.endpoints_in(nodes)
        if not rows:
            raise ValueError(f"{self!r} reads no node of {nodes!r}: its edges index other node sets")
        reader = self.edges.owner.astype(np.int64)
        keys = []
        for k in rows:
            ids = self.edge_index[k]
            away = nodes.owner[ids] != reader
            keys.append(reader[away] * nodes.n + ids[away])
        pairs = np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)
        readers, ids = pairs // max(nodes.n, 1), pairs % max(nodes.n, 1)
        holders = nodes.owner[ids].astype(np.int64)
        order = np.lexsort((ids, holders, readers))
        hit = self._halos[nodes] = (readers[order], holders[order], ids[order])
        return hit

    def halo_counts(self, nodes: Partition) -> tuple[int, ...]:
        """Rows each rank receives to read ``nodes`` along its edges (the halo), counted from the partitions alone.

        Usage: ``bytes_per_layer = sum(g.halo_counts(part)) * features * dtype.itemsize``
        """
        readers, _, _ = self._all_halos(nodes)
        return tuple(int(c) for c in np.bincount(readers, minlength=self.parts))

    def halo(self, nodes: Partition, me: int) -> HaloPlan:
        """Rank ``me``'s plan to read ``nodes`` (the source or the destination partition) along its edges.

        Usage: ``plan = g.halo(g.src, comm.index)``
        """
        key = (nodes, me)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        # NOTE: kept for the process's life: its tensors are real even when first asked for while torch.compile
        # traces on fake tensors (a fake one kept would poison every later call)
        with outside_dispatch_modes():
            plan = self._plans[key] = self._plan_halo(nodes, me)
        return plan

    def _plan_halo(self, nodes: Partition, me: int) -> HaloPlan:
        readers, holders, ids = self._all_halos(nodes)
        mine = readers == me
        halo_ids, from_whom = ids[mine], holders[mine]
        recv = tuple((int(q), int(c)) for q, c in enumerate(np.bincount(from_whom, minlength=self.parts)) if c)
        held = holders == me
        send = []
        for r in range(self.parts):
            rows = nodes.local_index[ids[held & (readers == r)]]
            if rows.size:
                send.append((r, torch.from_numpy(np.array(rows, dtype=np.int64))))
        own = nodes.counts[me]
        ext = np.full(nodes.n, -1, dtype=np.int64)
        ext[nodes.items(me)] = np.arange(own)
        ext[halo_ids] = own + np.arange(len(halo_ids))
        return HaloPlan(me, own, recv, tuple(send), halo_ids, torch.from_numpy(ext))
