"""Window ops on blocks with the halo messages of every grid dim in flight while the interior is computed.

Usage (a block rule calls it; off unless turned on: ``with domain.window_overlap(True): y = net(bs)``)::

    out = overlapped_windows(local, spec, windows, kernel)   # None: take the plain path
    if out is None:
        Step(kernel, (Boxes(input, window_plans(...)[0]),), ...)   # the plain path: a step

The 1-D engine (``mesh3d.domain.halo.overlap``), nested over the grid dims. Level ``i`` holds rows
extended along grid dims ``< i`` and its own rows along the others. It posts its grid line's halo
messages, runs level ``i + 1`` on its own rows (the *interior*: the kernel reads only the outputs
whose windows along dim ``i`` lie in its own rows), waits, extends the received rows ``L`` and ``T``
along the grid dims ``> i`` (one plain exchange per dim: the corners), and computes the two strips
along dim ``i``. A strip's rows are ``E(L)`` followed by the own rows of ``E(own)`` the interior
level already extended, so every row crosses each grid line once: the halo bytes are those of
``blocks.gather_planned`` (the identity ``E(cat(L, own, T)) = cat(E(L), E(own), E(T))``, the
passes along later dims being row by row). Padding rows never travel: the kernel adds them.

Agreement: a level's choice (overlap or not) depends only on the global sizes along its dim and
this rank's index there, which every rank of a grid line ``j != i`` shares: so the ranks of each line
post the same exchanges in the same order (forward, and backward by autograd's creation order).
Ranks of line ``i`` itself may choose differently: both paths send and receive the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.layouts.blocks import halo_rows_only
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.halo.windows import plan_window
from mesh3d.domain.halo.overlap import OVERLAP_STATS, HaloInFlight, WindowSplit, split_window
from mesh3d.domain.comm.rows import ExchangePlan, plan_exchange
from mesh3d.domain.core.settings import SETTINGS

__all__ = ["Kernel", "overlapped_windows"]

#: The local op on fully extended rows: ``kernel(rows, pads)``, ``pads[i]`` the padding it adds on grid dim i.
Kernel = Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor]
#: Rows to keep of a tensor along some grid dims, (tensor dim, first row, rows) each.
_Narrows = tuple[tuple[int, int, int], ...]
#: What the kernel reads along each grid dim done so far: (first row, rows or -1 for all, pad before, pad after).
_Reads = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class _Level:
    """One grid dim: its tensor dim and line, the plain exchange and padding, and the overlap (or None)."""

    dim: int
    line: DomainComm
    plain: ExchangePlan  # halo rows only (no padding rows)
    pads: tuple[int, int]
    halo: tuple[ExchangePlan, WindowSplit, WindowSplit] | None  # full plan, window split, the strips' split


def _level(dim: int, sizes: tuple[int, ...], line: DomainComm, window: tuple[int, int, int, int, int],
           enabled: bool, last: bool) -> _Level:
    kernel, stride, dilation, lo, hi = window
    plan = plan_window(sizes, kernel, stride, dilation, lo, hi)
    plain, left, right = halo_rows_only(sizes, plan, line.index)
    halo = None
    if enabled and line.size > 1 and plain.recv:
        full = plan_exchange(sizes, plan.needs, line.index)
        split = split_window(full, 0, dilation * (kernel - 1) + 1, stride, plan.out_sizes[line.index])
        if split is not None:
            halo = (full, split, _without_padding(split, with_own=last))
    return _Level(dim, line, plain, (left, right), halo)


def _without_padding(split: WindowSplit, with_own: bool) -> WindowSplit:
    """The split whose two strips hold no padding row, and their own rows only ``with_own`` (on the last grid dim:
    the strips are then the kernel's rows, their own rows' gradient added in place, not through an input-sized narrow)."""
    lead = tuple(p for p in split.lead if p.kind == "recv")
    trail = tuple(p for p in split.trail if p.kind == "recv")
    end = split.own.start + split.own.count
    left_own = split.left_own if with_own else 0
    right_own_start = split.right_own_start if with_own else end
    return WindowSplit(lead, split.own, trail, 0, split.interior, left_rows=sum(p.count for p in lead) + left_own,
                       left_own=left_own, right_rows=sum(p.count for p in trail) + end - right_own_start,
                       right_own_start=right_own_start)


def overlapped_windows(local: torch.Tensor, spec: BlockSpec, windows: Sequence[tuple[int, int, int, int, int]],
                       kernel: Kernel) -> torch.Tensor | None:
    """The window op's local output on blocks with its halos overlapped (module docstring), or None where no
    grid dim overlaps on this rank (overlap off, nothing received, no interior): then take the plain path.

    ``windows[i]``: (kernel, stride, dilation, pad before, pad after) along grid dim ``i``.
    Usage: ``out = overlapped_windows(local, spec, [(3, 1, 1, 1, 1)] * 2, lambda rows, pads: conv(rows, pads))``
    """
    n = len(spec.dims)
    levels = tuple(_level(d, s, line, w, SETTINGS.value.overlap.blocks, i == n - 1)
                   for i, (d, s, line, w) in enumerate(zip(spec.dims, spec.sizes, spec.lines, windows)))
    if all(lv.halo is None for lv in levels):
        return None
    OVERLAP_STATS.calls += 1
    out, _ = _Nested(levels, kernel).run(local, 0, ())
    return out


class _Nested:
    def __init__(self, levels: tuple[_Level, ...], kernel: Kernel) -> None:
        self.levels, self.kernel = levels, kernel

    def compute(self, rows: torch.Tensor, reads: _Reads) -> torch.Tensor:
        """The kernel on ``rows`` (extended along every grid dim), read as ``reads`` says."""
        pads = []
        for lv, (start, count, lo, hi) in zip(self.levels, reads):
            if count >= 0 and (start, count) != (0, rows.shape[lv.dim]):  # NOTE: a narrow's backward is input-sized
                rows = rows.narrow(lv.dim, start, count)
            pads.append((lo, hi))
        return self.kernel(rows, pads)

    def plain_reads(self, first: int) -> _Reads:
        return tuple((0, -1, *lv.pads) for lv in self.levels[first:])

    def extend(self, rows: torch.Tensor, first: int) -> torch.Tensor:
        """``rows`` extended along grid dims ``first..`` by plain exchanges (one after the other: corners travel)."""
        for lv in self.levels[first:]:
            rows = gather_rows(rows, lv.dim, lv.plain, lv.line)
        return rows

    def run(self, rows: torch.Tensor, i: int, reads: _Reads) -> tuple[torch.Tensor, Callable[[_Narrows], torch.Tensor]]:
        """The output read as ``reads`` from ``rows`` (extended along grid dims < i), and a function giving
        rows of ``rows`` extended along grid dims >= i (for the strips of the levels outside)."""
        if i == len(self.levels):
            return self.compute(rows, reads), lambda narrows: _narrowed(rows, narrows)
        lv = self.levels[i]
        if lv.halo is None:
            return self.run(gather_rows(rows, lv.dim, lv.plain, lv.line), i + 1, reads + ((0, -1, *lv.pads),))
        full, split, received = lv.halo
        halo = HaloInFlight(lv.dim, full, received, lv.line, 0.0)
        shard = halo.begin(rows)
        interior, extended_own = self.run(shard, i + 1, reads + ((*split.interior, 0, 0),))
        left, right = halo.finish(shard)
        own, at = split.own, split.right_own_start
        if i == len(self.levels) - 1:  # the strips hold their own rows already
            lead, trail = left.narrow(lv.dim, 0, left.shape[lv.dim] - split.left_own), right.narrow(
                lv.dim, own.start + own.count - at, right.shape[lv.dim] - (own.start + own.count - at))
            strips = (left, right)
        else:
            corners = self.extend(torch.cat([left, right], lv.dim), i + 1)
            lead, trail = corners.split([left.shape[lv.dim], right.shape[lv.dim]], lv.dim)
            strips = (torch.cat([lead, extended_own(((lv.dim, own.start, split.left_own),))], lv.dim),
                      torch.cat([extended_own(((lv.dim, at, own.start + own.count - at),)), trail], lv.dim))
        parts = []
        if split.left_rows:
            parts.append(self.compute(strips[0], reads + ((0, -1, lv.pads[0], 0),) + self.plain_reads(i + 1)))
        parts.append(interior)
        if split.right_rows:
            parts.append(self.compute(strips[1], reads + ((0, -1, 0, lv.pads[1]),) + self.plain_reads(i + 1)))

        def extended(narrows: _Narrows) -> torch.Tensor:
            middle = extended_own(narrows + ((lv.dim, own.start, own.count),))
            return torch.cat([_narrowed(lead, narrows), middle, _narrowed(trail, narrows)], lv.dim)

        return torch.cat(parts, lv.dim) if len(parts) > 1 else parts[0], extended


def _narrowed(rows: torch.Tensor, narrows: _Narrows) -> torch.Tensor:
    for dim, start, count in narrows:
        rows = rows.narrow(dim, start, count)
    return rows
