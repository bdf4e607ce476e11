"""The halo planner: which input rows each domain rank needs for a sliding-window op (output ownership).

Usage::

    plan = plan_window(sizes=(4, 3, 3), kernel=3, stride=1, dilation=2, pad_left=2, pad_right=2)
    plan.out_sizes      # (4, 3, 3): each rank's share of the global output
    plan.needs[1]       # (2, 3, ..., 8): global input rows rank 1 reads (-1 = padding)

Output ownership. Output j of a window op (kernel k, stride s, dilation d, left padding p) reads
input rows s*j - p + d*t, t = 0..k-1. Each rank owns the outputs whose *window centre*
c_j = s*j - p + d*(k-1)//2 (clipped into [0, N)) lies in its input shard. Centres increase with j,
so every rank owns one contiguous run [a, b) and concatenating the ranks' outputs in rank order is
the one-process output, for any kernel (odd or even), stride, dilation and asymmetric padding:
no alignment condition on shard offsets. Because ownership follows the input layout, a
"same"-shaped stride-1 op keeps the layout unchanged and a rank reads only ~d*(k-1)/2 rows
beyond each side of its shard (the minimum halo). Rank r then needs rows
[a*s - p, (b-1)*s - p + d*(k-1)]; rows outside [0, N) are padding (-1, filled by the caller) and
rows held by other ranks, however far away, are fetched by ``exchange.gather_rows``. A rank that owns
no output (tiny shard, large stride) needs nothing and produces an empty shard.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

from mesh3d.domain.split import offsets_of

__all__ = ["WindowPlan", "plan_window", "window_output_length"]


@dataclass(frozen=True)
class WindowPlan:
    out_sizes: tuple[int, ...]
    needs: tuple[tuple[int, ...], ...]


def window_output_length(length: int, kernel: int, stride: int, dilation: int, pad_left: int, pad_right: int) -> int:
    return (length + pad_left + pad_right - dilation * (kernel - 1) - 1) // stride + 1


def owners_by_position(sizes: tuple[int, ...], positions: list[int]) -> list[int]:
    """The rank owning each (clipped) global input position; empty shards own nothing."""
    offsets = offsets_of(sizes)
    total = sum(sizes)
    starts = [o for o, s in zip(offsets, sizes) if s > 0]
    ranks = [r for r, s in enumerate(sizes) if s > 0]
    return [ranks[bisect.bisect_right(starts, min(max(c, 0), total - 1)) - 1] for c in positions]


def sizes_from_owners(owners: list[int], parts: int) -> tuple[int, ...]:
    counts = [0] * parts
    for r in owners:
        counts[r] += 1
    return tuple(counts)


@lru_cache(maxsize=512)
def plan_window(
    sizes: tuple[int, ...],
    kernel: int,
    stride: int,
    dilation: int,
    pad_left: int,
    pad_right: int,
    out_length: int | None = None,
) -> WindowPlan:
    """Plan a window op along a sharded dim of global length ``sum(sizes)`` (see module docstring)."""
    n = sum(sizes)
    m = out_length if out_length is not None else window_output_length(n, kernel, stride, dilation, pad_left, pad_right)
    if m <= 0 or n == 0:
        raise ValueError(
            f"the window (kernel={kernel}, stride={stride}, dilation={dilation}, padding=({pad_left}, {pad_right})) "
            f"does not fit the sharded dim of global length {n}: the output would be empty"
        )
    centre = dilation * (kernel - 1) // 2
    owners = owners_by_position(sizes, [j * stride - pad_left + centre for j in range(m)])
    out_sizes = sizes_from_owners(owners, len(sizes))
    needs = []
    for a in offsets_of(out_sizes):
        b = a + out_sizes[len(needs)]
        if a == b:
            needs.append(())
            continue
        lo, hi = a * stride - pad_left, (b - 1) * stride - pad_left + dilation * (kernel - 1)
        needs.append(tuple(g if 0 <= g < n else -1 for g in range(lo, hi + 1)))
    return WindowPlan(out_sizes, tuple(needs))
