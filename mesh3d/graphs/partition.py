"""Partitions of a graph's items (nodes or edges) over the domain ranks, and the partitioners that make them.

Usage::

    part = Partition(owner=[0, 1, 1, 0, 2], parts=3)      # any assignment: not only contiguous ranges
    part.counts, part.items(1), part.local_index           # (2, 2, 1), [1, 2], each item's row on its owner
    part = sfc_partition(xyz, parts=4)                     # a Hilbert (or Morton) curve over coordinates
    part = sfc_partition(xy, parts=3, sizes=(5, 0, 7))     # uneven, one part empty
    part = grid_block_partition(((3, 2), (4, 4)))          # the lat x lon blocks of a grid field (row-major points)
    part = latlon_block_partition(lat, lon, grid_lat, grid_lon, ((3, 2), (4, 4)))   # points by the block they fall in
    part = metis_partition(edge_index, num_nodes, parts=4) # METIS (pymetis) when installed, else a BFS fallback

A rank holds its items in ascending global order (``items(r)``), whatever the assignment, so a layout is the owner
array alone: every rank knows every rank's items, and two partitions are equal when their owner arrays are.
No process group here (numpy and torch only).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence

import numpy as np
import torch

from mesh3d._torch_private import outside_dispatch_modes
from mesh3d.graphs.compiled_tables import table

__all__ = ["Partition", "bfs_order", "grid_block_partition", "latlon_block_partition", "metis_available",
           "metis_partition", "sfc_keys", "sfc_partition", "split_order"]


class Partition:
    """An assignment of ``len(owner)`` items to ``parts`` ranks; each rank holds its items in ascending global order.

    Usage: ``p = Partition([0, 1, 1, 0], 2); p.counts == (2, 2); p.items(0) -> [0, 3]; p.local_index -> [0, 0, 1, 1]``

    Equal (and hashed) by content: the owner array and the number of parts.
    """

    def __init__(self, owner: Sequence[int] | np.ndarray | torch.Tensor, parts: int) -> None:
        if isinstance(owner, torch.Tensor):
            owner = owner.detach().cpu().numpy()
        array = np.asarray(owner)
        if not isinstance(parts, (int, np.integer)) or parts < 1:
            raise ValueError(f"Partition: parts={parts!r} must be a positive int (the domain ranks)")
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"Partition: owner must be a 1-D array of ints (one rank per item), got dtype "
                             f"{array.dtype} and shape {array.shape}")
        if array.size and (array.min() < 0 or array.max() >= parts):
            raise ValueError(f"Partition: owners must lie in 0..{parts - 1}; got {int(array.min())}..{int(array.max())}")
        self.owner = array.astype(np.int32)
        self.owner.setflags(write=False)
        self.parts = int(parts)
        self.counts = tuple(int(c) for c in np.bincount(self.owner, minlength=self.parts))
        self._digest = hashlib.blake2b(self.owner.tobytes() + self.parts.to_bytes(4, "little"), digest_size=16).digest()
        self._order: np.ndarray | None = None
        self._local: np.ndarray | None = None
        self._tensors: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def n(self) -> int:
        """The number of items (global)."""
        return int(self.owner.size)

    def __len__(self) -> int:
        return self.n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Partition) and other._digest == self._digest and other.parts == self.parts

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        return f"Partition(n={self.n}, parts={self.parts}, counts={self.counts})"

    def __deepcopy__(self, memo: dict) -> Partition:
        return self  # immutable

    @property
    def digest(self) -> str:
        """A content hash (hex): what a checkpoint records to know the partition it was written with."""
        return self._digest.hex()

    @property
    def order(self) -> np.ndarray:
        """Every item, rank by rank (each rank's in ascending order): the order of a gather of all ranks' rows."""
        if self._order is None:
            self._order = np.argsort(self.owner, kind="stable")
            self._order.setflags(write=False)
        return self._order

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each rank's items start in ``order``."""
        return tuple(int(v) for v in np.concatenate([[0], np.cumsum(self.counts)[:-1]]))

    def items(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s items (global indices, ascending)."""
        start = self.offsets[rank]
        return self.order[start:start + self.counts[rank]]

    @property
    def local_index(self) -> np.ndarray:
        """Each item's row on its owner (its position in ``items(owner)``)."""
        if self._local is None:
            local = np.empty(self.n, dtype=np.int64)
            starts = np.asarray(self.offsets, dtype=np.int64)
            local[self.order] = np.arange(self.n, dtype=np.int64) - starts[self.owner[self.order]]
            local.setflags(write=False)
            self._local = local
        return self._local

    def tensor(self, what: str, rank: int = -1) -> torch.Tensor:
        """A cached int64 tensor: ``"items"`` of ``rank``, ``"owner"`` or ``"local_index"`` (of every item).

        Usage: ``rows = plain.index_select(0, part.tensor("items", me))``
        """
        key = (what, rank)
        hit = self._tensors.get(key)
        if hit is None:
            array = self.items(rank) if what == "items" else self.owner if what == "owner" else self.local_index
            with outside_dispatch_modes():  # NOTE: real even when first asked for while torch.compile traces
                hit = self._tensors[key] = torch.from_numpy(np.array(array, dtype=np.int64))
        return table(hit)

    def take(self, keep: np.ndarray) -> Partition:
        """The partition of the items where ``keep`` (a global bool mask) is true, in their order.

        Usage: ``edges.take(src != dst)``
        """
        return Partition(self.owner[np.asarray(keep, dtype=bool)], self.parts)

    @staticmethod
    def concat(pieces: Sequence[Partition]) -> Partition:
        """Items of ``pieces`` one after the other (a ``cat`` along the items).

        Usage: ``Partition.concat([edges, nodes])  # edges, then a self-loop per node``
        """
        if len({p.parts for p in pieces}) != 1:
            raise ValueError(f"Partition.concat: pieces over different numbers of parts {[p.parts for p in pieces]}")
        return Partition(np.concatenate([p.owner for p in pieces]), pieces[0].parts)


def split_order(order: np.ndarray, parts: int, sizes: Sequence[int] | None = None) -> Partition:
    """Cut ``order`` (every item once) into ``parts`` consecutive runs: even, or of ``sizes`` (zeros allowed).

    Usage: ``split_order(np.argsort(keys), 4)``
    """
    n = len(order)
    if sizes is None:
        base, extra = divmod(n, parts)
        sizes = [base + (r < extra) for r in range(parts)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != parts or any(s < 0 for s in sizes) or sum(sizes) != n:
        raise ValueError(f"sizes={tuple(sizes)} must be {parts} non-negative ints summing to the {n} items")
    owner = np.empty(n, dtype=np.int32)
    owner[np.asarray(order)] = np.repeat(np.arange(parts, dtype=np.int32), sizes)
    return Partition(owner, parts)


# ----------------------------------------------------------------------------- space-filling curves
def _quantize(points: np.ndarray, bits: int) -> np.ndarray:
    lo, hi = points.min(0), points.max(0)
    span = np.where(hi > lo, hi - lo, 1.0)
    return np.minimum(((points - lo) / span * (1 << bits)).astype(np.uint64), np.uint64((1 << bits) - 1))


def sfc_keys(points: np.ndarray, curve: str = "hilbert") -> np.ndarray:
    """Each point's position along a Hilbert or Morton curve over the bounding box of ``points`` ``(N, d)``, d <= 3.

    Usage: ``order = np.argsort(sfc_keys(xyz))``

    Skilling's transpose form of the Hilbert index, vectorized: O(N * bits * d) numpy operations, no Python loop
    over points.
    """
    points = np.asarray(points, dtype=np.float64)
    if points.ndim != 2 or not 1 <= points.shape[1] <= 3:
        raise ValueError(f"sfc_keys: points must be (N, d) with d in 1..3, got shape {points.shape}")
    if curve not in ("hilbert", "morton"):
        raise ValueError(f"sfc_keys: curve={curve!r} must be 'hilbert' or 'morton'")
    n, d = points.shape
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    bits = 63 // d
    x = [c.copy() for c in _quantize(points, bits).T]
    one = np.uint64(1)
    if curve == "hilbert":
        q = np.uint64(1 << (bits - 1))
        while q > one:  # undo excess work
            p = q - one
            for i in range(d):
                high = (x[i] & q) != 0
                x[0] = np.where(high, x[0] ^ p, x[0])
                t = np.where(high, np.uint64(0), (x[0] ^ x[i]) & p)
                x[0] ^= t
                x[i] ^= t
            q >>= one
        for i in range(1, d):  # Gray encode
            x[i] ^= x[i - 1]
        t = np.zeros(n, dtype=np.uint64)
        q = np.uint64(1 << (bits - 1))
        while q > one:
            t = np.where((x[d - 1] & q) != 0, t ^ (q - one), t)
            q >>= one
        for i in range(d):
            x[i] ^= t
    key = np.zeros(n, dtype=np.uint64)
    for b in range(bits - 1, -1, -1):
        for i in range(d):
            key = (key << one) | ((x[i] >> np.uint64(b)) & one)
    return key


def sfc_partition(points: np.ndarray, parts: int, *, curve: str = "hilbert", sizes: Sequence[int] | None = None) -> Partition:
    """Nodes in the order of a space-filling curve over their coordinates, cut into ``parts`` runs (even or ``sizes``).

    Usage: ``sfc_partition(lat_lon_to_xyz(lat, lon), 4)``; ``sfc_partition(xy, 3, sizes=(10, 0, 22))``

    O(N log N); on a quasi-uniform mesh each part is a compact region, so halos stay small.
    """
    return split_order(np.argsort(sfc_keys(points, curve), kind="stable"), parts, sizes)


# ----------------------------------------------------------------------------- grid blocks
def _block_of_rows(sizes: Sequence[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), [int(s) for s in sizes])


def grid_block_partition(sizes: Sequence[Sequence[int]]) -> Partition:
    """The points of a grid (row-major ids) owned as the blocks of a domain grid own them (``BlockSpec.sizes``).

    Usage: ``grid_block_partition(((3, 2), (4, 4)))  # a 5 x 8 lat x lon grid on a 2 x 2 domain grid``

    Domain rank ``r`` is the grid coordinate ``grid_coords(r, grid)`` (row-major), as the domain grid orders them.
    """
    grid = tuple(len(s) for s in sizes)
    coords = np.meshgrid(*[_block_of_rows(s) for s in sizes], indexing="ij")
    owner = np.ravel_multi_index(tuple(c.ravel() for c in coords), grid) if coords[0].size else np.zeros(0, int)
    return Partition(owner, int(np.prod(grid)))


def _nearest(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
    at = np.clip(np.searchsorted(sorted_values, values), 1, len(sorted_values) - 1) if len(sorted_values) > 1 else \
        np.zeros(len(values), dtype=np.int64)
    if len(sorted_values) == 1:
        return at
    left = sorted_values[at - 1]
    return np.where(np.abs(values - left) <= np.abs(sorted_values[at] - values), at - 1, at)


def latlon_block_partition(lat: np.ndarray, lon: np.ndarray, grid_lat: np.ndarray, grid_lon: np.ndarray,
                           sizes: Sequence[Sequence[int]]) -> Partition:
    """Points (degrees) owned by the rank whose lat x lon block of the grid holds their nearest grid point.

    Usage: ``latlon_block_partition(mesh_lat, mesh_lon, ds.lat, ds.lon, xs.spec.sizes)``

    A mesh partitioned so lies over the same ranks as the grid field's blocks: grid-to-mesh and mesh-to-grid edges
    then cross ranks only near the blocks' borders. ``grid_lon`` is evenly spaced (periodic).
    """
    grid_lat, grid_lon = np.asarray(grid_lat, dtype=np.float64), np.asarray(grid_lon, dtype=np.float64)
    if len(sizes) != 2 or sum(sizes[0]) != len(grid_lat) or sum(sizes[1]) != len(grid_lon):
        raise ValueError(f"latlon_block_partition: sizes={sizes} must be ((lat rows per block), (lon columns per "
                         f"block)) summing to the grid's {len(grid_lat)} x {len(grid_lon)}")
    order = np.argsort(grid_lat)
    rows = order[_nearest(grid_lat[order], np.asarray(lat, dtype=np.float64))]
    step = (grid_lon[1] - grid_lon[0]) if len(grid_lon) > 1 else 360.0
    cols = np.rint(((np.asarray(lon, dtype=np.float64) - grid_lon[0]) % 360.0) / step).astype(np.int64) % len(grid_lon)
    grid = (len(sizes[0]), len(sizes[1]))
    owner = np.ravel_multi_index((_block_of_rows(sizes[0])[rows], _block_of_rows(sizes[1])[cols]), grid)
    return Partition(owner, grid[0] * grid[1])


# ----------------------------------------------------------------------------- from the graph
def _csr(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """The undirected adjacency (both directions, no self loops, no duplicates) as CSR (xadj, adjncy)."""
    src, dst = np.asarray(edge_index[0], dtype=np.int64), np.asarray(edge_index[1], dtype=np.int64)
    keep = src != dst
    a, b = np.concatenate([src[keep], dst[keep]]), np.concatenate([dst[keep], src[keep]])
    pairs = np.unique(a * num_nodes + b)
    a, b = pairs // num_nodes, pairs % num_nodes
    xadj = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(a, minlength=num_nodes), out=xadj[1:])
    return xadj, b


def bfs_order(edge_index: np.ndarray, num_nodes: int) -> np.ndarray:
    """Nodes in breadth-first order (level by level, each component from its lowest node): neighbours end up close.

    Usage: ``split_order(bfs_order(edge_index, n), parts)`` (the graph partitioner without METIS)
    """
    xadj, adjncy = _csr(edge_index, num_nodes)
    seen = np.zeros(num_nodes, dtype=bool)
    out: list[np.ndarray] = []
    start = 0
    while start < num_nodes:
        if seen[start]:
            start += 1
            continue
        frontier = np.array([start])
        seen[start] = True
        while frontier.size:
            out.append(frontier)
            lo, hi = xadj[frontier], xadj[frontier + 1]
            lengths = hi - lo
            gather = np.repeat(lo - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
            nxt = np.unique(adjncy[gather])
            nxt = nxt[~seen[nxt]]
            seen[nxt] = True
            frontier = nxt
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def metis_available() -> bool:
    """Whether ``pymetis`` (METIS's Python binding) imports here.

    Usage: ``method = "metis" if metis_available() else "bfs"``
    """
    return importlib.util.find_spec("pymetis") is not None


def metis_partition(edge_index: np.ndarray | torch.Tensor, num_nodes: int, parts: int, *, method: str = "auto",
                    seed: int = 0) -> Partition:
    """A partition of the graph's nodes that cuts few edges: METIS (k-way, through ``pymetis``), or without it the
    breadth-first order cut into even runs.

    Usage: ``metis_partition(edge_index, n, 4)``; ``method="bfs"`` forces the fallback, ``"metis"`` requires METIS

    ``edge_index`` is ``(2, E)``, read as undirected.
    """
    if isinstance(edge_index, torch.Tensor):
        edge_index = edge_index.detach().cpu().numpy()
    edge_index = np.asarray(edge_index)
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"metis_partition: edge_index must be (2, E), got shape {edge_index.shape}")
    if method not in ("auto", "metis", "bfs"):
        raise ValueError(f"metis_partition: method={method!r} must be 'auto', 'metis' or 'bfs'")
    use_metis = method == "metis" or (method == "auto" and metis_available())
    if parts == 1 or num_nodes == 0 or not use_metis:
        return split_order(bfs_order(edge_index, num_nodes), parts)
    try:
        import pymetis  # noqa: PLC0415 - optional dependency (the graph extra)
    except ImportError as err:
        raise ImportError("metis_partition(method='metis') needs pymetis: pip install pymetis "
                          "(or the graph extra: pip install mesh3d[graph]); method='bfs' needs nothing") from err
    xadj, adjncy = _csr(edge_index, num_nodes)
    options = pymetis.Options(seed=seed)
    if hasattr(pymetis, "CSRAdjacency"):  # NOTE: pymetis 2025.2 deprecates xadj=/adjncy= (removed in 2027)
        _, membership = pymetis.part_graph(parts, pymetis.CSRAdjacency(xadj, adjncy), options=options)
    else:
        _, membership = pymetis.part_graph(parts, xadj=xadj, adjncy=adjncy, options=options)
    return Partition(np.asarray(membership), parts)
