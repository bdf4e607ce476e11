"""Row maps as runs: which global rows of the sharded dim a rank needs, and who sends what to whom.

Usage::

    from mesh3d.domain.comm.rows import Span, plan_exchange
    needs = ((Span.fill(1), Span.rows(0, 5)), (Span.rows(4, 9), Span.fill(1)))   # one map per rank
    plan = plan_exchange(sizes=(5, 4), needs=needs, me=1)
    plan.pieces   # in result order: ("recv", peer 0, buffer rows 0..1), ("own", local 0..4), ("fill", 1)

A rank's need is a short tuple of ``Span``s, each a run of consecutive global rows ``[start, stop)``
or a run of fill rows (padding). A window op's need is at most three spans whatever the shard
size, so planning, hashing and caching cost O(D) Python, never O(rows). Rows in another order
(reflect padding) are runs of one row; such maps are as short as the padding is wide.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.plan_cache import plan_cache

__all__ = ["ExchangePlan", "Piece", "RowMap", "Span", "map_length", "plan_exchange", "runs_from_indices"]


class Span(NamedTuple):
    """Global rows ``[start, stop)`` in order, or (``is_fill``) ``stop - start`` rows of the fill value.

    Usage: ``Span.rows(4, 9)``, ``Span.fill(2)``
    """

    start: int
    stop: int
    is_fill: bool = False

    @staticmethod
    def rows(start: int, stop: int) -> Span:
        return Span(start, stop, False)

    @staticmethod
    def fill(count: int) -> Span:
        return Span(0, count, True)

    def __len__(self) -> int:  # type: ignore[override]
        return self.stop - self.start


RowMap = tuple[Span, ...]


def map_length(row_map: RowMap) -> int:
    """Rows in a map (fill rows included).

    Usage: ``map_length((Span.fill(1), Span.rows(0, 4)))  # 5``
    """
    return sum(s.stop - s.start for s in row_map)


def runs_from_indices(indices: Iterable[int]) -> RowMap:
    """Compress global row indices (``-1`` = fill) into runs; consecutive ascending rows merge.

    Usage: ``runs_from_indices([-1, 0, 1, 2, 1])  # (fill(1), rows(0, 3), rows(1, 2))``
    """
    out: list[Span] = []
    for g in indices:
        if out:
            last = out[-1]
            if g < 0 and last.is_fill:
                out[-1] = Span(0, last.stop + 1, True)
                continue
            if g >= 0 and not last.is_fill and g == last.stop:
                out[-1] = Span(last.start, g + 1)
                continue
        out.append(Span.fill(1) if g < 0 else Span.rows(g, g + 1))
    return tuple(out)


class Piece(NamedTuple):
    """One run of a rank's result, in result order: ``kind`` is "own" (``start`` = local row),
    "recv" (``peer``'s message, ``start`` = row in that message) or "fill"."""

    kind: str
    count: int
    start: int = 0
    peer: int = -1


@dataclass(frozen=True)
class ExchangePlan:
    """What one rank copies, sends and receives to build its result (see module docstring)."""

    length: int  # rows of the result
    pieces: tuple[Piece, ...]  # the result, in order
    send: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (peer, ((local start, count), ...))
    recv: tuple[tuple[int, int], ...]  # (peer, rows in its message)
    local_rows: int  # rows of this rank's shard

    @property
    def is_local_view(self) -> bool:
        """The result is this rank's whole shard, as is: nothing moves, nothing is copied."""
        return len(self.pieces) == 1 and self.pieces[0].kind == "own" and self.pieces[0].start == 0 \
            and self.pieces[0].count == self.local_rows

    @property
    def moves_nothing(self) -> bool:
        return not self.send and not self.recv


def _owned_parts(span: Span, starts: Sequence[int], ends: Sequence[int], ranks: Sequence[int]):
    """Split a row run into (rank, global start, global stop) by owner: O(log D + parts)."""
    g = span.start
    if torch.compiler.is_dynamo_compiling():  # NOTE: Dynamo cannot trace the C ``bisect``; D is small, scan instead
        i = sum(1 for s in starts if s <= g) - 1
    else:
        i = bisect.bisect_right(starts, g) - 1
    while g < span.stop:
        if i < 0 or g >= ends[i]:
            raise IndexError(f"row {g} is outside the global length {ends[-1] if ends else 0}")
        stop = min(span.stop, ends[i])
        yield ranks[i], g, stop
        g = stop
        i += 1


@plan_cache(maxsize=4096)
def plan_exchange(sizes: tuple[int, ...], needs: tuple[RowMap, ...], me: int) -> ExchangePlan:
    """Rank ``me``'s plan, given every rank's row map over a dim split as ``sizes``: O(D + spans).

    Usage: ``plan = plan_exchange((4, 4), ((Span.rows(0, 5),), (Span.rows(3, 8),)), me=0)``
    """
    offsets = offsets_of(sizes)
    nonempty = [r for r, s in enumerate(sizes) if s > 0]
    starts = [offsets[r] for r in nonempty]
    ends = [offsets[r] + sizes[r] for r in nonempty]
    pieces: list[Piece] = []
    recv: dict[int, int] = {}
    for span in needs[me]:
        if span.is_fill:
            pieces.append(Piece("fill", span.stop - span.start))
            continue
        for owner, g0, g1 in _owned_parts(span, starts, ends, nonempty):
            if owner == me:
                pieces.append(Piece("own", g1 - g0, g0 - offsets[me]))
            else:
                pieces.append(Piece("recv", g1 - g0, recv.get(owner, 0), owner))
                recv[owner] = recv.get(owner, 0) + g1 - g0
    send: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    lo, hi = offsets[me], offsets[me] + sizes[me]
    for peer, row_map in enumerate(needs):
        if peer == me or not sizes[me]:
            continue
        runs = tuple((max(s.start, lo) - lo, min(s.stop, hi) - max(s.start, lo))
                     for s in row_map if not s.is_fill and s.start < hi and s.stop > lo)
        if runs:
            send.append((peer, runs))
    return ExchangePlan(
        length=map_length(needs[me]),
        pieces=tuple(_merge(pieces)),
        send=tuple(send),
        recv=tuple(sorted(recv.items())),
        local_rows=sizes[me],
    )


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Join neighbouring pieces that continue each other (fewer slices and copies)."""
    out: list[Piece] = []
    for p in pieces:
        if out:
            q = out[-1]
            if q.kind == p.kind == "fill":
                out[-1] = Piece("fill", q.count + p.count)
                continue
            if q.kind == p.kind and q.peer == p.peer and q.kind != "fill" and q.start + q.count == p.start:
                out[-1] = Piece(q.kind, q.count + p.count, q.start, q.peer)
                continue
        out.append(p)
    return out


@plan_cache(maxsize=512)
def block_needs(sizes: tuple[int, ...]) -> tuple[tuple[Span, ...], ...]:
    """Each rank's rows of the layout ``sizes``: one run each (O(D))."""
    out, at = [], 0
    for s in sizes:
        out.append((Span.rows(at, at + s),) if s else ())
        at += s
    return tuple(out)
