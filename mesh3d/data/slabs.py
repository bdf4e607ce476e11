"""``SlabDataset``: a dataset whose items are only this domain rank's rows of each sample.

Arrays hold samples along their first axis (``(N, C, H, W)``, ``(N, C, D, H, W)`` ...). Item ``i``
is a dict with ``"index"`` (``i``) and, per array, this domain rank's rows of ``array[i]`` along
``dim`` (a plain tensor, so ``DataLoader`` workers and ``collate`` handle it as usual). After
collation :meth:`SlabDataset.to_domain` wraps the slabs as ``DomainTensor`` s (no communication).

Usage::

    ds = SlabDataset({"x": "inputs.npy", "y": "targets.npy"}, dim=2)     # (N, C, H, W): rows of H
    loader = MeshDataLoader(ds, MeshSampler(len(ds), global_batch_size=8))
    for batch in loader:
        batch = ds.to_domain(batch)       # batch["x"]: DomainTensor (B, C, H_global, W), my rows
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from mesh3d.domain import domain_comm, from_local, split_sizes
from mesh3d.domain.io import open_array, read_rows

__all__ = ["SlabDataset"]


class SlabDataset(Dataset):
    """Per sample, this domain rank's slab of each array (read alone: other ranks' rows are never read).

    Usage: ``ds = SlabDataset("fields.npy", dim=2); ds[0]["x"]  # my rows of sample 0 along dim 2``

    Args:
        arrays: one array-like or ``.npy`` path (named ``"x"``), or a dict of them; samples along axis 0.
        dim: the sharded dim *of a batch* (axis 0 is the sample/batch axis), the same for every array,
            or a dict per name (``None``: that array is read whole).
        sizes: per-rank rows as for ``domain.shard`` (default ``torch.chunk``'s split), or a dict per name.
        domain: ``(parts, index)``; default this rank's domain group (read once, here, so workers
            never need the process group).
    """

    def __init__(self, arrays: Any, dim: int | Mapping[str, int | None] = 2,
                 sizes: Sequence[int] | Mapping[str, Sequence[int] | None] | None = None, *,
                 domain: tuple[int, int] | None = None) -> None:
        named = dict(arrays) if isinstance(arrays, Mapping) else {"x": arrays}
        if not named or "index" in named:
            raise ValueError("SlabDataset needs at least one array, and none may be named 'index' (the sample id)")
        self.arrays = {name: open_array(a) for name, a in named.items()}
        lengths = {name: a.shape[0] for name, a in self.arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"SlabDataset arrays hold different numbers of samples: {lengths}")
        self.dims = {n: (dim.get(n) if isinstance(dim, Mapping) else dim) for n in self.arrays}
        self.sizes_given = {n: (sizes.get(n) if isinstance(sizes, Mapping) else sizes) for n in self.arrays}
        if domain is None:
            comm = domain_comm()
            domain = (comm.size, comm.index)
        self.parts, self.part = domain
        self.sizes: dict[str, tuple[int, ...] | None] = {}
        for name, array in self.arrays.items():
            d = self.dims[name]
            if d is None:
                self.sizes[name] = None
                continue
            if not isinstance(d, int) or not 1 <= d < len(array.shape):
                raise ValueError(f"SlabDataset: dim {d!r} for {name!r} must name a non-sample axis (1.."
                                 f"{len(array.shape) - 1}) of its shape {tuple(array.shape)}")
            self.sizes[name] = split_sizes(array.shape[d], self.parts, self.sizes_given[name])

    def __len__(self) -> int:
        return next(iter(self.arrays.values())).shape[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range for a dataset of {len(self)}")
        item: dict[str, Any] = {"index": i}
        for name, array in self.arrays.items():
            d = self.dims[name]
            if d is None:
                item[name] = torch.as_tensor(array[i]).clone()
            else:
                item[name] = read_rows(array, d - 1, self.parts, self.part, self.sizes[name], prefix=(i,))[0]
        return item

    def to_domain(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A collated batch with each slab wrapped as a ``DomainTensor`` (sharded along its ``dim``)."""
        out = dict(batch)
        for name, d in self.dims.items():
            if d is not None:
                out[name] = from_local(batch[name], dim=d, sizes=self.sizes[name])
        return out

    @property
    def bytes_read(self) -> int:
        """Bytes this process read from its ``.npy`` files (arrays of other kinds do not count them)."""
        return sum(getattr(a, "bytes_read", 0) for a in self.arrays.values())
