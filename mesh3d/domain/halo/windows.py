"""The halo planner: which input rows each domain rank needs for a sliding-window op (output ownership).

Usage::

    plan = plan_window(sizes=(4, 3, 3), kernel=3, stride=1, dilation=2, pad_left=2, pad_right=2)
    plan.out_sizes      # (4, 3, 3): each rank's share of the global output
    plan.needs[1]       # (Span.rows(2, 9),): global input rows rank 1 reads, as runs

Output ownership. Output j of a window op (kernel k, stride s, dilation d, left padding p) reads
input rows s*j - p + d*t, t = 0..k-1. Each rank owns the outputs whose *window centre*
c_j = s*j - p + d*(k-1)//2 (clipped into [0, N)) lies in its input shard. Centres increase with j,
so every rank owns one contiguous run [a, b) and concatenating the ranks' outputs in rank order is
the one-process output, for any kernel (odd or even), stride, dilation and asymmetric padding:
no alignment condition on shard offsets. Because ownership follows the input layout, a
"same"-shaped stride-1 op keeps the layout unchanged and a rank reads only ~d*(k-1)/2 rows
beyond each side of its shard (the minimum halo). Rank r then needs rows
[a*s - p, (b-1)*s - p + d*(k-1)]: at most three runs (padding, real rows, padding), computed in
O(D) from the run boundaries, never row by row. Rows held by other ranks, however far away, are
fetched by ``exchange.gather_rows``. A rank that owns no output needs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh3d.domain.comm.rows import ExchangePlan, RowMap, Span, plan_exchange
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.plan_cache import plan_cache
import torch
from mesh3d.domain.core.tensor import DomainTensor

__all__ = ["WindowPlan", "WindowProbe", "extent_map", "plan_window", "sizes_by_first_index", "window_exchange",
           "window_output_length"]


@dataclass(frozen=True)
class WindowPlan:
    """Each rank's share of the output and the input rows (runs, padding as fill) it reads."""

    out_sizes: tuple[int, ...]
    needs: tuple[RowMap, ...]

    def __hash__(self) -> int:
        """Hashed once: a plan is looked up on every call of its op (``window_exchange``'s cache), and its rows are
        tuples of runs per rank."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.out_sizes, self.needs))
            object.__setattr__(self, "_hash", h)  # NOTE: frozen: past the dataclass's own __setattr__
        return h


def window_output_length(length: int, kernel: int, stride: int, dilation: int, pad_left: int, pad_right: int) -> int:
    return (length + pad_left + pad_right - dilation * (kernel - 1) - 1) // stride + 1


def sizes_by_first_index(sizes: tuple[int, ...], out_length: int, first_index: Callable[[int], int]) -> tuple[int, ...]:
    """Output sizes when outputs go to the rank holding their (non-decreasing) source row.

    ``first_index(o)`` is the first output whose source row is ``>= o``. Outputs whose source lies
    before the first non-empty shard go to it, those beyond the end to the last: O(D).
    Usage: ``sizes_by_first_index((4, 4), 8, lambda o: 2 * o)  # sources j // 2 -> (8, 0)``
    """
    offsets = offsets_of(sizes)
    nonempty = [r for r, s in enumerate(sizes) if s > 0]
    out = [0] * len(sizes)
    if not nonempty:
        return tuple(out)
    bounds = [0] + [min(max(first_index(offsets[r]), 0), out_length) for r in nonempty[1:]] + [out_length]
    for i, r in enumerate(nonempty):
        out[r] = max(0, bounds[i + 1] - bounds[i])
    return tuple(out)


def extent_map(lo: int, hi: int, length: int) -> RowMap:
    """Global rows ``lo..hi`` (inclusive) of a dim of ``length`` as runs: fill, rows, fill."""
    if hi < lo:
        return ()
    out: list[Span] = []
    left = min(hi, -1) - lo + 1
    if left > 0:
        out.append(Span.fill(left))
    if max(lo, 0) <= min(hi, length - 1):
        out.append(Span.rows(max(lo, 0), min(hi, length - 1) + 1))
    right = hi - max(lo, length) + 1
    if right > 0:
        out.append(Span.fill(right))
    return tuple(out)


@plan_cache(maxsize=1024)
def plan_window(
    sizes: tuple[int, ...],
    kernel: int,
    stride: int,
    dilation: int,
    pad_left: int,
    pad_right: int,
    out_length: int | None = None,
) -> WindowPlan:
    """Plan a window op along a sharded dim of global length ``sum(sizes)`` (see module docstring).

    Usage: ``plan_window((5, 4), kernel=3, stride=2, dilation=1, pad_left=1, pad_right=1).out_sizes  # (3, 2)``
    """
    n = sum(sizes)
    m = out_length if out_length is not None else window_output_length(n, kernel, stride, dilation, pad_left, pad_right)
    if m <= 0 or n == 0:
        raise ValueError(
            f"the window (kernel={kernel}, stride={stride}, dilation={dilation}, padding=({pad_left}, {pad_right})) "
            f"does not fit the sharded dim of global length {n}: the output would be empty"
        )
    centre = dilation * (kernel - 1) // 2
    # First output whose centre s*j - p + centre reaches row o: j >= (o + p - centre) / s.
    out_sizes = sizes_by_first_index(sizes, m, lambda o: -(-(o + pad_left - centre) // stride))
    needs = []
    for a, count in zip(offsets_of(out_sizes), out_sizes):
        if count == 0:
            needs.append(())
            continue
        lo = a * stride - pad_left
        hi = (a + count - 1) * stride - pad_left + dilation * (kernel - 1)
        needs.append(extent_map(lo, hi, n))
    return WindowPlan(out_sizes, tuple(needs))


class WindowProbe:
    """Collects (input length, output length) of every window op along the sharded dim while active.

    Usage: ``with WindowProbe() as probe: model(xs)``; then ``probe.lengths`` (the dispatcher reports to it).
    """

    active: list[WindowProbe] = []

    def __init__(self) -> None:
        self.lengths: list[tuple[int, int]] = []

    def __enter__(self) -> WindowProbe:
        WindowProbe.active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        WindowProbe.active.remove(self)

    @classmethod
    def note(cls, length_in: int, length_out: int) -> None:
        for probe in cls.active:
            probe.lengths.append((length_in, length_out))


@plan_cache(maxsize=2048)
def window_exchange(sizes: tuple[int, ...], plan: WindowPlan, me: int, kernel_pads: bool) -> tuple[ExchangePlan, int]:
    """This rank's exchange for a window op, and the padding left to the kernel.

    Usage: ``xplan, pad = window_exchange(sizes, plan_window(sizes, 3, 1, 1, 1, 1), me, kernel_pads=True)``

    NOTE: the kernel pads both sides of the sharded dim by the same amount, so the smaller of this
    rank's two padding runs is left to it and only the difference (edge ranks, asymmetric windows)
    becomes explicit fill rows. At domain=1 (or any rank needing no remote rows and symmetric
    padding) the plan is then the shard itself: the kernel runs on it with no copy at all.
    """
    mine = plan.needs[me]
    left = mine[0].stop if mine and mine[0].is_fill else 0
    right = mine[-1].stop if len(mine) > 1 and mine[-1].is_fill else 0
    pad = min(left, right) if kernel_pads and len(mine) > 1 else 0
    if pad:
        trimmed = list(mine)
        trimmed[0] = Span.fill(left - pad)
        trimmed[-1] = Span.fill(right - pad)
        mine = tuple(s for s in trimmed if s.stop > s.start)
    needs = plan.needs[:me] + (mine,) + plan.needs[me + 1:]
    return plan_exchange(sizes, needs, me), pad


@dataclass(frozen=True)
class Window:
    """A window op's input rows (``plan``): resolved to ``Extended``; the local kernel pads symmetrically.

    ``kernel_pads=False`` when the local function cannot take padding on the sharded dim (then
    every fill row is materialized). ``overlap=(extent, stride)`` of the window along the sharded dim
    declares that the local function may be called on row strips of the input (each with no padding
    on the sharded dim, results concatenated): the dispatcher then computes the interior while the
    halo rows travel (``mesh3d.domain.halo.overlap``).

    Usage: ``Step(lambda ext: conv(ext.tensor, ext.pad), (Window(xs, plan_window(xs.spec.sizes, 3, 1, 1, 1, 1)),))``
    """

    x: DomainTensor
    plan: WindowPlan
    fill: float = 0.0
    kernel_pads: bool = True
    overlap: tuple[int, int] | None = None


@dataclass(frozen=True)
class Extended:
    """``tensor``: this rank's input rows for a window op; ``pad``: the padding the kernel must add on both
    sides of the sharded dim (the remaining padding rows are already in ``tensor``).

    Usage: ``lambda ext: F.conv1d(ext.tensor, w, padding=ext.pad)`` as a ``Step``'s compute
    """

    tensor: torch.Tensor
    pad: int
