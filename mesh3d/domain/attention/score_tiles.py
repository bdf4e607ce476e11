"""Tiles of the score matrix: which (query, key) pairs of a block attend (skip / full / masked), from global rows.

Usage::

    rule = MaskRule(left=None, right=0)                       # causal; MaskRule(w, 0): a causal sliding window
    for tile in tiles(Segment.run(a, b), Segment.run(c, d), rule):
        mask = tile_mask(tile, qseg, kseg, rule, user_mask, rows="global")   # None, bool or float

Every rank knows every row's global index (a slab's offsets, a token grid's block order), so a block of
queries against a block of keys is classified exactly, however uneven or empty the shards: *skip* (no
query sees a key), *full* (every query sees every key: no mask), or *masked*. On contiguous runs the
masked part is trimmed to the rows and keys that meet, and a causal diagonal becomes the kernel's own
top-left causal flag (no mask tensor). Elsewhere (a token grid's block order) the mask comes from index
comparisons, O(block). A user's mask of global shape ``(..., S, S)`` is sliced per block by the same
indices; a mask sharded like the queries (rows local) is sliced by local rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


import torch
from mesh3d.domain.core.plan_cache import plan_property

__all__ = ["MaskRule", "Segment", "Tile", "slice_user_mask", "tile_mask", "tile_work", "tiles"]


@dataclass(frozen=True)
class Segment:
    """Rows of a block: their global indices as runs ``(start, stop)`` in local order.

    Usage: ``Segment.run(4, 9).rows  # 5``; ``Segment(((0, 2), (6, 8))).index()``
    """

    runs: tuple[tuple[int, int], ...]

    @staticmethod
    def run(start: int, stop: int) -> Segment:
        return Segment(((start, stop),) if stop > start else ())

    @staticmethod
    def joined(runs: Iterable[tuple[int, int]]) -> Segment:
        """Runs in this order, empty ones dropped and each joined to the one before when it continues it."""
        out: list[tuple[int, int]] = []
        for a, b in runs:
            if b <= a:
                continue
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return Segment(tuple(out))

    @plan_property
    def rows(self) -> int:
        return sum(b - a for a, b in self.runs)

    @plan_property
    def lo(self) -> int:
        return min((a for a, _ in self.runs), default=0)

    @plan_property
    def hi(self) -> int:
        """One past the largest index."""
        return max((b for _, b in self.runs), default=0)

    @property
    def contiguous(self) -> bool:
        return len(self.runs) == 1

    @plan_property
    def _index(self) -> torch.Tensor:
        parts = [torch.arange(a, b) for a, b in self.runs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def index(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global index of every row, in local order (int64)."""
        return self._index.to(device)

    def start_of(self, lo: int, hi: int) -> int | None:
        """The global index of row ``lo`` when rows ``lo..hi`` lie in one run (a slice then reads them), else None."""
        at = 0
        for a, b in self.runs:
            if lo < at + b - a:
                return a + lo - at if hi <= at + b - a else None
            at += b - a
        return None


@dataclass(frozen=True)
class MaskRule:
    """Query ``i`` sees key ``j`` when ``i - left <= j <= i + right`` (None: unbounded), and where the user's
    mask allows (``user``: one is given). ``MaskRule(None, 0)`` is causal; ``MaskRule()`` sees everything."""

    left: int | None = None
    right: int | None = None
    user: bool = False

    @property
    def banded(self) -> bool:
        return self.left is not None or self.right is not None


@dataclass(frozen=True)
class Tile:
    """Query rows ``[q0, q1)`` of a segment against key rows ``[k0, k1)`` of a block (local positions).

    ``causal``: the kernel's top-left causal flag does all the masking; ``banded``: a mask from global
    indices is needed; the user's mask, if any, applies on top.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    banded: bool = False


def _sees_all(qlo: int, qhi: int, klo: int, khi: int, rule: MaskRule) -> bool:
    """Every query in [qlo, qhi) sees every key in [klo, khi) (bounds of non-empty sets)."""
    return (rule.right is None or khi - 1 <= qlo + rule.right) and (rule.left is None or klo >= qhi - 1 - rule.left)


def _sees_none(qlo: int, qhi: int, klo: int, khi: int, rule: MaskRule) -> bool:
    return (rule.right is not None and klo > qhi - 1 + rule.right) or \
        (rule.left is not None and khi - 1 < qlo - rule.left)


#: Segments with at most this many runs each are classified run by run (a zigzag's two chunks); longer ones
#: (a token grid's block rows) as a whole, with a mask from indices where the band cuts through.
_RUNWISE = 4


def tiles(q: Segment, k: Segment, rule: MaskRule) -> list[Tile]:
    """The kernel calls for queries ``q`` against keys ``k``: [] when no query sees a key.

    Usage: ``tiles(Segment.run(0, 8), Segment.run(4, 12), MaskRule(None, 0))``
    """
    if not q.rows or not k.rows or _sees_none(q.lo, q.hi, k.lo, k.hi, rule):
        return []
    if not rule.banded or _sees_all(q.lo, q.hi, k.lo, k.hi, rule):
        return [Tile(0, q.rows, 0, k.rows)]
    if len(q.runs) > _RUNWISE or len(k.runs) > _RUNWISE:
        return [Tile(0, q.rows, 0, k.rows, banded=True)]
    out = []
    qa = 0
    for a, b in q.runs:
        ka = 0
        for c, d in k.runs:
            out += [Tile(p.q0 + qa, p.q1 + qa, p.k0 + ka, p.k1 + ka, p.causal, p.banded)
                    for p in _run_tiles(a, b, c, d, rule)]
            ka += d - c
        qa += b - a
    return out


def _run_tiles(a: int, b: int, c: int, d: int, rule: MaskRule) -> list[Tile]:
    """Pieces of queries ``[a, b)`` against keys ``[c, d)`` (both runs), at positions within the runs."""
    if _sees_none(a, b, c, d, rule):
        return []
    if _sees_all(a, b, c, d, rule):
        return [Tile(0, b - a, 0, d - c)]
    if rule.left is None and rule.right == 0:  # causal: keys before the first query, then the diagonal
        out = [Tile(0, b - a, 0, min(a, d) - c)] if c < a else []
        s = max(a, c)  # queries before s see none of the keys from s on; from s, top-left aligned
        if s < min(b, d):
            out.append(Tile(s - a, b - a, s - c, min(b, d) - c, causal=True))
        return out
    # a band: trim to the queries that see some key and the keys some query sees
    r = rule.right if rule.right is not None else d
    left = rule.left if rule.left is not None else b
    q0, q1 = max(a, c - r), min(b, d + left)
    k0, k1 = max(c, a - left), min(d, b + r)
    return [Tile(q0 - a, q1 - a, k0 - c, k1 - c, banded=not _sees_all(q0, q1, k0, k1, rule))]


def tile_work(piece: Tile) -> int:
    """(query, key) pairs the kernel computes for a piece: the area, or the lower triangle for the causal flag."""
    rows, cols = piece.q1 - piece.q0, piece.k1 - piece.k0
    if piece.causal:
        return cols * (cols + 1) // 2 + (rows - cols) * cols
    return rows * cols


def _take(t: torch.Tensor, dim: int, seg: Segment, lo: int, hi: int, offset: int | None) -> torch.Tensor:
    """Rows ``lo..hi`` of segment ``seg`` along ``dim`` of ``t``: by global index (``offset`` None) or at local
    rows ``offset + lo..`` ; a size-1 (broadcast) dim is left alone."""
    if t.shape[dim] == 1:
        return t
    start = offset + lo if offset is not None else seg.start_of(lo, hi)
    if start is not None:
        return t.narrow(dim, start, hi - lo)
    return t.index_select(dim, seg.index(t.device)[lo:hi])


def slice_user_mask(mask: torch.Tensor, piece: Tile, q: Segment, k: Segment, q_offset: int | None) -> torch.Tensor:
    """The user's mask for a piece: rows by the queries' global indices (``q_offset`` None) or, for a mask
    sharded like the queries, at local rows ``q_offset + ...``; columns by the keys' global indices.

    Usage: ``slice_user_mask(bias, piece, qseg, kseg, None)``
    """
    rows = _take(mask, mask.ndim - 2, q, piece.q0, piece.q1, q_offset)
    return _take(rows, mask.ndim - 1, k, piece.k0, piece.k1, None)


def _band(piece: Tile, q: Segment, k: Segment, rule: MaskRule, device) -> torch.Tensor:
    qi = q.index(device)[piece.q0:piece.q1, None]
    ki = k.index(device)[None, piece.k0:piece.k1]
    mask = torch.ones(qi.shape[0], ki.shape[1], dtype=torch.bool, device=device)
    if rule.right is not None:
        mask &= ki <= qi + rule.right
    if rule.left is not None:
        mask &= ki >= qi - rule.left
    return mask


def tile_mask(piece: Tile, q: Segment, k: Segment, rule: MaskRule, user: torch.Tensor | None,
               q_offset: int | None, device) -> torch.Tensor | None:
    """The mask tensor for a piece (None: the piece needs none): the band from indices, the user's slice, or both.

    Usage: ``mask = tile_mask(piece, qseg, kseg, rule, bias, None, q.device)``
    """
    band = _band(piece, q, k, rule, device) if piece.banded else None
    if user is None:
        return band
    part = slice_user_mask(user, piece, q, k, q_offset)
    if band is None:
        return part
    if part.dtype == torch.bool:
        return part & band
    return part.masked_fill(~band, float("-inf"))
