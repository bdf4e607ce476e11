"""Node fields of a graph from storage: each domain rank reads its own nodes (and, if asked, its halo), nothing else.

Usage::

    ds = NodeDataset({"x": StoredArray("flow.zarr", "x"), "y": StoredArray("flow.zarr", "y")}, part)   # (sample, node, ...)
    sample = ds[0]              # {"index": 0, "x": this rank's rows (ascending node ids), "y": ...}
    ds = NodeDataset(arrays, part, halo=graph)     # also "x_halo": the rows of the nodes its edges read from others
    batch = ds.to_domain(next(iter(loader)))       # collated (B, nodes, ...) -> graph domain tensors (node dim 1)
    ds.bytes_read                                  # what storage handed out (StoredArray's count)

Rows are read one storage chunk at a time (the span of this rank's ids in it), so a zarr or HDF5 array hands out only
the chunks that hold this rank's nodes, each once; a partition along a space-filling curve of a mesh numbered the
same way reads a few runs of whole chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mesh3d.domain.api import domain_comm
from mesh3d.domain.layouts.graph import nodes_from_local
from mesh3d.graphs import Graph, Partition
from mesh3d.manager import DistributedManager

__all__ = ["NodeDataset", "read_rows"]


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(first id, stop id, position in ``ids``) of each run of consecutive ids (``ids`` ascending)."""
    if len(ids) == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [len(ids)]])
    return [(int(ids[a]), int(ids[b - 1]) + 1, int(a)) for a, b in zip(starts, stops)]


def _pieces(array: Any, ids: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """Slices to read for ``ids``: one per storage chunk touched (zarr, HDF5), else one per run of consecutive ids;
    each ``(start, stop, rows of ids within it)``."""
    chunks = getattr(array, "chunks", None)
    if chunks is not None and len(chunks) > 1 and len(ids):
        which = ids // int(chunks[1])
        cuts = np.flatnonzero(np.diff(which)) + 1
        return [(int(g[0]), int(g[-1]) + 1, g - g[0]) for g in np.split(ids, cuts)]
    return [(a, b, np.arange(b - a)) for a, b, _ in _runs(ids)]


def read_rows(array: Any, sample: int, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (ascending node ids) of ``array[sample]`` (node dim first after the sample): one read per storage
    chunk that holds some (or per run of consecutive ids where the array has no chunks).

    Usage: ``rows = read_rows(zarr_array, 3, part.items(rank))``
    """
    parts = [np.asarray(array[sample, a:b])[rows] for a, b, rows in _pieces(array, np.asarray(ids))]
    if parts:
        return np.concatenate(parts, 0)
    shape = tuple(array.shape[2:])
    return np.zeros((0, *shape), dtype=np.asarray(array[sample, 0:0]).dtype)


class NodeDataset(Dataset):
    """Samples of node fields stored as ``(sample, node, ...)`` arrays; each rank reads its partition's nodes.

    Usage: ``NodeDataset({"x": arr}, part)[i]["x"]  # (this rank's nodes, ...)``

    ``rank``: the domain rank (default: the manager's, or 0); ``halo``: a ``Graph`` whose halo of ``partition`` is
    read too (``<name>_halo``, rows in ``graph.halo(partition, rank).halo_ids`` order).
    """

    def __init__(self, arrays: Mapping[str, Any], partition: Partition, *, rank: int | None = None,
                 halo: Graph | None = None, dtype: torch.dtype = torch.float32) -> None:
        if not arrays:
            raise ValueError("NodeDataset: give at least one array, e.g. {'x': StoredArray('flow.zarr', 'x')}")
        lengths = {name: (len(a), a.shape[1] if len(a.shape) > 1 else None) for name, a in arrays.items()}
        if len({n for n, _ in lengths.values()}) != 1 or any(k != partition.n for _, k in lengths.values()):
            raise ValueError(f"NodeDataset: every array must be (samples, {partition.n} nodes, ...) with the same "
                             f"number of samples; got (samples, nodes) {lengths}")
        if rank is None:
            rank = DistributedManager().axis_rank("domain") if DistributedManager.is_initialized() else 0
        self.arrays, self.partition, self.rank, self.dtype = dict(arrays), partition, rank, dtype
        self.ids = partition.items(rank)
        self.halo_ids = None if halo is None else halo.halo(partition, rank).halo_ids
        self.halo_order = None if self.halo_ids is None else np.argsort(self.halo_ids, kind="stable")

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range for a dataset of {len(self)}")
        out: dict[str, Any] = {"index": i}
        for name, array in self.arrays.items():
            out[name] = torch.from_numpy(read_rows(array, i, self.ids)).to(self.dtype)
            if self.halo_ids is not None:  # read in ascending id order, then put in the halo's order
                rows = read_rows(array, i, self.halo_ids[self.halo_order])
                back = np.empty_like(self.halo_order)
                back[self.halo_order] = np.arange(len(back))
                out[f"{name}_halo"] = torch.from_numpy(rows[back]).to(self.dtype)
        return out

    def to_domain(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A collated batch with each field a graph domain tensor ``(B, nodes, ...)`` (node dim 1); halo rows stay plain."""
        comm = domain_comm()
        return {k: nodes_from_local(v, self.partition, comm, dim=1) if k in self.arrays else v for k, v in batch.items()}

    @property
    def bytes_read(self) -> int:
        """Bytes storage handed out so far (arrays that count them: ``StoredArray``)."""
        return sum(getattr(a, "bytes_read", 0) for a in self.arrays.values())
