"""Where each rank's sequence rows lie in the global order, and moving rows between such layouts.

Usage::

    slabs = slab_order((5, 3, 4))            # rank r: rows offset_r .. offset_r + size_r (one run)
    tokens = token_order(t.spec)             # a token grid: its block rows, one run per row of the block
    zig = zigzag_order(12, 3)                # causal balance: rank r holds chunks r and 2D-1-r of 2D
    q_zig = reorder_rows(q, 2, slabs, zig, comm)  # this rank's rows in the zigzag layout (differentiable)

A *layout* gives every domain rank its rows as a ``Segment`` (runs of global indices in local order). Rows
move with one ``gather_rows`` exchange: the source layout, read rank after rank, is a contiguous order of
all rows, in which the destination's runs are runs again; only rows that change rank travel, and the
backward sends gradients home (``exchange.gather_rows``). Planning costs O(runs), never O(rows).

The zigzag layout (ring-flash-attention's, for any length: 2D chunks whose lengths differ by at most one,
rank r holding chunks r and 2D-1-r) gives every rank the same causal work, and every ring step the same
work too when keys and values are laid out alike.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from mesh3d.domain.attention.score_tiles import Segment
from mesh3d.domain.core.specs import grid_coords
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.comm.rows import Span, plan_exchange
from mesh3d.domain.core.split import balanced_sizes, offsets_of
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.core.plan_cache import plan_cache

__all__ = ["RowOrder", "reorder_rows", "slab_order", "token_order", "zigzag_order"]

RowOrder = tuple[Segment, ...]


@plan_cache(maxsize=256)
def slab_order(sizes: tuple[int, ...]) -> RowOrder:
    """Slabs: rank r holds one run, ``offsets[r] .. offsets[r] + sizes[r]``.

    Usage: ``slab_order((5, 3))  # (Segment(((0, 5),)), Segment(((5, 8),)))``
    """
    return tuple(Segment.run(o, o + n) for o, n in zip(offsets_of(sizes), sizes))


@plan_cache(maxsize=256)
def zigzag_order(length: int, ranks: int) -> RowOrder:
    """Rank r holds chunks r and 2D-1-r of ``2 * ranks`` chunks (lengths differ by at most one).

    Usage: ``zigzag_order(10, 2)  # rank 0: rows 0..3 and 8..10; rank 1: rows 3..8``
    """
    chunks = balanced_sizes(length, 2 * ranks)
    starts = offsets_of(chunks)
    out = []
    for r in range(ranks):
        out.append(Segment.joined((starts[c], starts[c] + chunks[c]) for c in (r, 2 * ranks - 1 - r)))
    return tuple(out)


def _token_runs(spec: TokenSpec, rank: int) -> Segment:
    grid = tuple(len(s) for s in spec.sizes)
    coords = grid_coords(rank, grid)
    shape = spec.grid_shape
    lo = [offsets_of(s)[c] for s, c in zip(spec.sizes, coords)]
    n = [s[c] for s, c in zip(spec.sizes, coords)]
    runs = [(0, spec.prefix)] if rank == 0 and spec.prefix else []  # Segment.joined merges whole grid rows
    if all(n):
        for lead in itertools.product(*(range(a, a + m) for a, m in zip(lo[:-1], n[:-1]))):
            flat = 0
            for i, size in zip(lead, shape[:-1]):
                flat = flat * size + i
            start = spec.prefix + flat * shape[-1] + lo[-1]
            runs.append((start, start + n[-1]))
    return Segment.joined(runs)


@plan_cache(maxsize=64)
def token_order(spec: TokenSpec) -> RowOrder:
    """A token grid: each rank's tokens in its local (block) order, one run per row of its block (prefix
    tokens first on rank 0).

    Usage: ``token_order(t.spec)[r].index()  # == t.spec.global_index_of(r)``
    """
    return tuple(_token_runs(spec, r) for r in range(spec.comm.size))


@plan_cache(maxsize=256)
def _needs(src: RowOrder, dst: RowOrder) -> tuple[tuple[int, ...], tuple[tuple[Span, ...], ...]]:
    """(source rows per rank, each rank's destination runs as runs of the source read rank after rank)."""
    starts, table = [], []  # every source run, sorted by global start: (start, stop, position in source order)
    at = 0
    for seg in src:
        for a, b in seg.runs:
            table.append((a, b, at))
            at += b - a
    table.sort()
    starts = [a for a, _, _ in table]
    needs = []
    for seg in dst:
        spans: list[Span] = []
        for a, b in seg.runs:
            i = bisect.bisect_right(starts, a) - 1
            while a < b:
                s0, s1, pos = table[i]
                if not s0 <= a < s1:
                    raise ValueError(f"row {a} of the destination layout is in no source run")
                stop = min(b, s1)
                spans.append(Span.rows(pos + a - s0, pos + stop - s0))
                a, i = stop, i + 1
        needs.append(tuple(_joined(spans)))
    return tuple(seg.rows for seg in src), tuple(needs)


def _joined(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for s in spans:
        if out and out[-1].stop == s.start:
            out[-1] = Span.rows(out[-1].start, s.stop)
        else:
            out.append(s)
    return out


def reorder_rows(local: torch.Tensor, dim: int, src: RowOrder, dst: RowOrder, comm: DomainComm) -> torch.Tensor:
    """This rank's rows of layout ``dst``, from ``local`` (its rows of layout ``src``) along ``dim``; differentiable.

    Usage: ``q_zig = reorder_rows(q, 2, slab_order(sizes), zigzag_order(n, D), comm)``
    """
    if src == dst:
        return local
    sizes, needs = _needs(src, dst)
    return gather_rows(local, dim, plan_exchange(sizes, needs, comm.index), comm)
