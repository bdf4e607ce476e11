"""Where a field lives on the mesh: this rank's (lat, lon) block of a global ``(H, W)`` grid, aligned to store tiles.

A forecast store's chunks are tiles of the globe that do not depend on the mesh (the store a job of 8 ranks writes
is the store one process writes), so the domain split follows the tiles: along each split grid dim every rank's
block starts on a tile edge (``aligned_sizes``), and no tile is written by two ranks. On a 2-D domain grid
``(P, Q)`` latitude is split over P and longitude over Q; on a 1-D grid, latitude (slabs).

Usage::

    blocks = FieldBlocks.for_mesh((721, 1440), tile=(91, 180))   # from the DistributedManager (or one process)
    blocks.rows, blocks.cols                                    # this rank's [start, stop) along lat and lon
    x = blocks.wrap(local)                                      # a DomainTensor over the domain (plain in one process)
    rows, cols = block_of(x)                                    # the block any (B, C, H, W) state holds
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mesh3d.domain import aligned_sizes, from_local
from mesh3d.manager import DistributedManager

__all__ = ["FieldBlocks", "block_of", "default_tile", "relayout_like"]

#: The default tiles: at most 8 along latitude and along longitude (at 0.25 degrees, 91 x 180 points), none shorter
#: than 16 points (a small grid is not cut into chunks of a few kilobytes).
MAX_TILES, MIN_TILE = 8, 16


def default_tile(shape: tuple[int, int]) -> tuple[int, int]:
    """``min(8, n // 16)`` tiles along each dim (at least one): a domain grid of up to that many ranks aligns to them.

    Usage: ``default_tile((721, 1440))  # (91, 180); default_tile((32, 64))  # (16, 16)``
    """
    return tuple(math.ceil(n / min(MAX_TILES, max(1, n // MIN_TILE))) for n in shape)


@dataclass(frozen=True)
class FieldBlocks:
    """Every rank's rows along each split grid dim and this rank's block, for a global ``(H, W)`` field.

    Usage: ``FieldBlocks.for_mesh((32, 64), (4, 8)).rows  # (0, 16) on rank 0 of a 2 x 2 domain grid``
    """

    shape: tuple[int, int]
    grid: tuple[int, ...]
    coords: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]

    @classmethod
    def for_mesh(cls, shape: Sequence[int], tile: Sequence[int]) -> FieldBlocks:
        """The split of the current mesh's domain grid (one process: the whole field), aligned to ``tile``.

        Raises (naming the fix) when a grid dim has more ranks than the field has tiles along it.
        """
        shape_t = (int(shape[0]), int(shape[1]))
        if DistributedManager.is_initialized():
            dm = DistributedManager()
            grid = tuple(dm.domain_grid)
            coords = tuple(int(c) for c in np.unravel_index(dm.axis_rank("domain"), grid))  # row-major
        else:
            grid, coords = (1,), (0,)
        if len(grid) not in (1, 2):
            raise ValueError(f"a forecast splits latitude (a 1-D domain grid) or latitude x longitude (2-D), got the "
                             f"domain grid {grid}; initialize with domain=P or domain=(P, Q)")
        sizes = []
        for name, length, parts, t in zip(("latitude", "longitude"), shape_t, grid, tile):
            tiles = math.ceil(length / int(t))
            if parts > tiles:
                raise ValueError(f"the domain grid {grid} splits {name} over {parts} ranks, but the store has only "
                                 f"{tiles} tiles of {t} points along it (every rank needs its own tiles: no chunk is "
                                 f"written by two ranks); pass a smaller tile (tile=, --tile) or fewer ranks along it")
            sizes.append(aligned_sizes(length, parts, int(t)))
        return cls(shape_t, grid, coords, tuple(sizes))

    @property
    def rows(self) -> tuple[int, int]:
        s, c = self.sizes[0], self.coords[0]
        return sum(s[:c]), sum(s[:c + 1])

    @property
    def cols(self) -> tuple[int, int]:
        if len(self.grid) == 1:
            return 0, self.shape[1]
        s, c = self.sizes[1], self.coords[1]
        return sum(s[:c]), sum(s[:c + 1])

    @property
    def split(self) -> bool:
        return math.prod(self.grid) > 1

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's ``(B, C, h, w)`` block as a DomainTensor over the domain (the tensor itself in one process)."""
        if not self.split:
            return local
        if len(self.grid) == 1:
            return from_local(local, dim=2, sizes=self.sizes[0])
        return from_local(local, dims=(2, 3), sizes=self.sizes)


def block_of(x: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """``((H, W), rows, cols)``: the global (lat, lon) shape of a ``(B, C, H, W)`` state and the block this rank holds.

    Usage: ``(h, w), (r0, r1), (c0, c1) = block_of(x)  # plain, a lat or lon slab, or (lat, lon) blocks``
    """
    if x.ndim != 4:
        raise ValueError(f"a state must be (B, C, H, W), got shape {tuple(x.shape)}")
    h, w = int(x.shape[2]), int(x.shape[3])
    spec = getattr(x, "spec", None)
    if spec is None:
        return (h, w), (0, h), (0, w)
    if hasattr(spec, "dims"):
        if tuple(spec.dims) != (2, 3):
            raise ValueError(f"blocks must split (lat, lon) = dims (2, 3), got dims {spec.dims}")
        (r0, c0), (rh, cw) = spec.offsets, spec.local_sizes
        return (h, w), (r0, r0 + rh), (c0, c0 + cw)
    if spec.dim is None:
        return (h, w), (0, h), (0, w)
    if spec.dim not in (2, 3):
        raise ValueError(f"a state's slabs must split lat (dim 2) or lon (dim 3), got dim {spec.dim}")
    start, stop = spec.offset, spec.offset + spec.sizes[spec.comm.index]
    return ((h, w), (start, stop), (0, w)) if spec.dim == 2 else ((h, w), (0, h), (start, stop))


def relayout_like(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function wrapping a local block of ``x``'s shape (but any channels) in ``x``'s layout (plain: itself).

    Usage: ``wrap = relayout_like(x); noise = wrap(local_noise)``
    """
    spec = getattr(x, "spec", None)
    if spec is None:
        return lambda local: local
    if hasattr(spec, "dims"):
        return lambda local: from_local(local, dims=spec.dims, sizes=spec.sizes)
    if spec.dim is None:
        raise ValueError("relayout_like: a replicated domain tensor has no block; pass the sharded state")
    return lambda local: from_local(local, dim=spec.dim, sizes=spec.sizes)
