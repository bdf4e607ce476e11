"""Blocks each rank loaded itself: ``domain.from_local(block, dims=(2, 3), sizes=...)`` with no communication.

The slab form (``from_local(slab, dim, sizes)``) wraps a rank's own rows; a reader of (lat, lon) blocks, or of
any box-shaped piece of a sample, needs the same for a domain grid. Every rank passes the same per-dim sizes;
this rank's block must have its grid coordinates' sizes along each dim.

Usage::

    block = read_my_block()                                        # (B, C, h, w): my rows of H and columns of W
    xs = domain.from_local(block, dims=(2, 3), sizes=((5, 3), (4, 4)))   # a DomainTensor of global (B, C, 8, 8)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.core.tensor import DomainTensor, wrap_anew
from mesh3d.domain.layouts.blocks import grid_comms

__all__ = ["blocks_from_local"]


def blocks_from_local(local: torch.Tensor, dims: Sequence[int], sizes: Sequence[Sequence[int]],
                      comm: DomainComm) -> DomainTensor:
    """Wrap this rank's block (see ``domain.from_local(..., dims=...)``); checks run before anything else."""
    grid, lines = grid_comms(comm)
    if not all(isinstance(d, int) and -local.ndim <= d < local.ndim for d in dims):
        raise ValueError(f"domain.from_local: dims={tuple(dims)} must be dims of the {local.ndim}-D block")
    dims = tuple(d % local.ndim for d in dims)
    if len(set(dims)) != len(dims) or len(dims) != len(grid):
        raise ValueError(f"domain.from_local: dims={dims} must name {len(grid)} different dims, one per dim of the "
                         f"domain grid {grid}")
    if sizes is None or len(sizes) != len(dims):
        raise ValueError(f"domain.from_local: give sizes= per dim ({len(dims)} tuples of per-rank sizes), got {sizes!r}")
    layout = tuple(split_sizes(sum(s), g, s) for s, g in zip(sizes, grid))
    spec = BlockSpec(dims, layout, lines, comm)
    for d, want in zip(dims, spec.local_sizes):
        if local.shape[d] != want:
            raise ValueError(f"domain.from_local: this rank's block has {local.shape[d]} rows along dim {d} but its "
                             f"grid coordinate's size is {want} (sizes={layout})")
    return wrap_anew(local, spec)
