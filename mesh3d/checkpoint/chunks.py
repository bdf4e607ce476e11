"""Which global chunk (box) of each tensor a rank holds, and which part of it the rank writes.

A box is (global offsets, shape). For a DTensor it follows from (global shape, mesh,
placements) alone (Shard, Replicate, uneven shards, _StridedShard of FSDP-over-TP); a
plain tensor is the whole tensor. Ranks that hold the *same* box are replicas: the box is
split along dim 0 among them so that writes stay balanced and each element is written once.

Usage::

    box = local_box(tensor)                               # Box(offsets=(5, 0), shape=(5, 6))
    part = replica_part(box, replicas=[0, 2, 4], rank=2)  # the rows rank 2 writes
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from mesh3d._torch_private import local_shape_and_global_offset
from mesh3d.checkpoint.errors import CheckpointError

__all__ = ["Box", "local_box", "local_data", "replica_part", "overlap", "row_major_strides", "row_major_runs"]


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor in global coordinates."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def local_box(name: str, tensor: torch.Tensor) -> Box:
    """The box of the global tensor that ``tensor`` (DTensor or plain) holds on this rank."""
    if not isinstance(tensor, DTensor):
        return Box((0,) * tensor.dim(), tuple(tensor.shape))
    shape, offsets = local_shape_and_global_offset(tuple(tensor.shape), tensor.device_mesh, tuple(tensor.placements))
    local_shape = tuple(tensor.to_local().shape)
    if local_shape != shape:
        raise CheckpointError(
            f"tensor {name!r}: its local shard has shape {list(local_shape)} but placements {tensor.placements} "
            f"on global shape {list(tensor.shape)} imply {list(shape)}; this layout is not supported"
        )
    return Box(offsets, shape)


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a DTensor or a plain tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def replica_part(box: Box, replicas: list[int], rank: int) -> Box | None:
    """The part of ``box`` that ``rank`` writes when all of ``replicas`` hold it (None: nothing).

    Rows (dim 0) are split as evenly as possible, in replica order; a 0-dim box is
    written by the first replica only.
    """
    n, i = len(replicas), replicas.index(rank)
    if not box.shape:
        return box if i == 0 else None
    rows = box.shape[0]
    begin, end = rows * i // n, rows * (i + 1) // n
    if end <= begin or box.numel == 0:
        return None
    return Box((box.offsets[0] + begin, *box.offsets[1:]), (end - begin, *box.shape[1:]))


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when they do not meet."""
    offsets, shape = [], []
    for ao, an, bo, bn in zip(a.offsets, a.shape, b.offsets, b.shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return Box(tuple(offsets), tuple(shape))


def row_major_strides(shape: tuple[int, ...]) -> list[int]:
    """Element strides of a C-order tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def row_major_runs(chunk: Box, ov: Box) -> list[tuple[int, int]]:
    """(first element, element count) of each contiguous run of ``ov`` inside ``chunk``."""
    if not chunk.shape:
        return [(0, 1)]
    strides = row_major_strides(chunk.shape)
    local = [o - c for o, c in zip(ov.offsets, chunk.offsets)]
    k = len(chunk.shape) - 1  # first dim (from the right) where the overlap is not full width
    while k > 0 and ov.shape[k] == chunk.shape[k]:
        k -= 1
    run = ov.shape[k] * strides[k]
    base = local[k] * strides[k] + sum(local[d] * strides[d] for d in range(k + 1, len(local)))
    return [
        (base + sum((local[d] + i) * strides[d] for d, i in enumerate(idx)), run)
        for idx in itertools.product(*(range(n) for n in ov.shape[:k]))
    ]
