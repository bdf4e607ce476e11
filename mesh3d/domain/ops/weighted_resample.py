"""``F.interpolate`` in the modes with wider windows: ``bicubic`` (4 taps: a halo of 2), ``area``, and ``antialias``
(a window growing with the downsampling factor), on slabs and blocks, forward and backward.

Usage: automatic: ``F.interpolate(xs, scale_factor=2, mode="bicubic")``, ``F.interpolate(xs, size=(h, w),
mode="bilinear", antialias=True)``.

Every mode is separable: along the sharded dim the result is ``W @ x`` for a band matrix ``W`` (output rows x input
rows). ``W`` is torch's own: the same ``F.interpolate`` applied to the identity (each input row alone) gives its
columns, so every formula (the cubic's A = -0.75, the clamped borders, ``align_corners``, a ``scale_factor``'s
source scale, the antialiasing filters and their normalization) is torch's exactly. A rank owns the outputs whose
first source row it holds and gathers the rows its outputs read (``Rows``; on blocks along each grid line in turn).
The other dims are then resampled by torch's kernel with scale 1 along the sharded one (an exact identity in
every mode: the cubic's weights there are 0, 1, 0, 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.plan_cache import plan_cache
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.halo.windows import sizes_by_first_index
from mesh3d.domain.layouts.blocks import gather_along

__all__ = ["blocks_weighted_interpolate", "weighted_interpolate"]


@plan_cache(maxsize=128, run_at_trace_time=True)
def _weights(n: int, m: int, mode: str, align_corners, antialias: bool, scale_factor, dtype) -> torch.Tensor:
    """torch's (m, n) resampling matrix along one dim, from ``F.interpolate`` of the identity."""
    # NOTE: three columns, not one: torch 2.13's antialiased CPU kernel gives wrong weights for an input one column
    # wide (every output row the first row's); along a dim of 3 -> 3 it is the identity.
    basis = torch.eye(n, dtype=dtype).view(1, n, n, 1).expand(1, n, n, 3).contiguous()
    kwargs = {"mode": mode, "antialias": antialias} if mode != "area" else {"mode": mode}
    if mode != "area":
        kwargs["align_corners"] = align_corners
    if scale_factor is not None:
        out = F.interpolate(basis, scale_factor=(scale_factor, 1.0), **kwargs)
    else:
        out = F.interpolate(basis, size=(m, 3), **kwargs)
    return out[0, :, :, 0].t().contiguous()


@plan_cache(maxsize=128, run_at_trace_time=True)
def _plan(sizes: tuple[int, ...], m: int, mode: str, align_corners, antialias: bool, scale_factor, dtype):
    """(output sizes per rank, each rank's needed source rows, the weights matrix)."""
    w = _weights(sum(sizes), m, mode, align_corners, antialias, scale_factor, dtype)
    nonzero = w != 0
    first = torch.where(nonzero.any(1), nonzero.float().argmax(1), 0)
    last = (w.shape[1] - 1) - torch.where(nonzero.any(1), nonzero.flip(1).float().argmax(1), 0)
    # NOTE: a zero weight can open a window (bicubic with align_corners: 0, 1, 0, 0 at an exact source row), so the
    # first source rows are not quite monotone: ownership goes by their running max, the needs by the true ones.
    owner_row = torch.cummax(first, 0).values
    out_sizes = sizes_by_first_index(sizes, m, lambda row: int(torch.searchsorted(owner_row, row)))
    needs = []
    for a, c in zip(offsets_of(out_sizes), out_sizes):
        needs.append((Span.rows(int(first[a:a + c].min()), int(last[a:a + c].max()) + 1),) if c else ())
    return out_sizes, tuple(needs), w


def _apply(ext: torch.Tensor, dim: int, w: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Output rows ``rows`` along ``dim`` from the gathered source rows ``cols`` (``ext``)."""
    sub = w[rows[0]:rows[1], cols[0]:cols[1]].to(ext.dtype)
    return torch.movedim(torch.tensordot(sub, ext, dims=([1], [dim])), 0, dim)


def _rest(y: torch.Tensor, sharded: list[int], outs: list[int] | None, sfs: list[float] | None, mode: str,
          align_corners, antialias: bool) -> torch.Tensor:
    """The other spatial dims resampled by torch, scale 1 along the ``sharded`` ones."""
    nd = y.ndim - 2
    kwargs = {"mode": mode} if mode == "area" else {"mode": mode, "align_corners": align_corners,
                                                      "antialias": antialias}
    if outs is not None:
        size = [y.shape[2 + i] if 2 + i in sharded else outs[i] for i in range(nd)]
        if size == list(y.shape[2:]):
            return y
        return F.interpolate(y, size=size, **kwargs) if y.numel() else y.new_zeros(*y.shape[:2], *size) + 0 * y.sum()
    factors = [1.0 if 2 + i in sharded else f for i, f in enumerate(sfs)]
    if all(f == 1.0 for f in factors):
        return y
    if not y.numel():
        size = [y.shape[2 + i] if 2 + i in sharded else math.floor(y.shape[2 + i] * f) for i, f in enumerate(factors)]
        return y.new_zeros(*y.shape[:2], *size) + 0 * y.sum()
    return F.interpolate(y, scale_factor=factors, **kwargs)


def _targets(x: DomainTensor, shape: list[int], size, scale_factor, recompute_scale_factor):
    nd = x.ndim - 2
    sfs = None if scale_factor is None else (list(scale_factor) if isinstance(scale_factor, (list, tuple))
                                             else [scale_factor] * nd)
    if recompute_scale_factor and sfs is not None:
        size, sfs = [math.floor(g * f) for g, f in zip(shape, sfs)], None
    outs = [int(n) for n in size] if isinstance(size, (list, tuple)) else ([int(size)] * nd if size is not None else None)
    ms = outs if outs is not None else [math.floor(n * f) for n, f in zip(shape, sfs)]
    return outs, sfs, ms


def weighted_interpolate(input: DomainTensor, size, scale_factor, mode: str, align_corners, recompute_scale_factor,
                         antialias: bool, sp: int) -> Step:
    """The slab rule of ``F.interpolate`` in ``bicubic``/``area`` or with ``antialias`` (spatial dim ``sp`` sharded).

    Usage: ``return weighted_interpolate(xs, None, 2.0, "bicubic", False, None, False, 0)``
    """
    spec = input.spec
    outs, sfs, ms = _targets(input, list(input.global_shape[2:]), size, scale_factor, recompute_scale_factor)
    out_sizes, needs, w = _plan(spec.sizes, ms[sp], mode, align_corners, antialias,
                                None if sfs is None else float(sfs[sp]), input.dtype)
    me, dim = spec.comm.index, 2 + sp
    a = offsets_of(out_sizes)[me]
    rows = (a, a + out_sizes[me])
    cols = (needs[me][0].start, needs[me][0].stop) if needs[me] else (0, 0)

    def compute(ext):
        return _rest(_apply(ext, dim, w, rows, cols), [dim], outs, sfs, mode, align_corners, antialias)

    return Step(compute, (Rows(input, needs),), out=spec.with_sizes(out_sizes))


def blocks_weighted_interpolate(input: DomainTensor, size, scale_factor, mode: str, align_corners,
                                recompute_scale_factor, antialias: bool) -> DomainTensor:
    """The blocks rule of the same modes: one block dim after the other (each grid line gathers its source rows).

    Usage: ``blocks_weighted_interpolate(bs, (h, w), None, "bicubic", False, None, False)``
    """
    spec = input._spec
    assert isinstance(spec, BlockSpec)
    outs, sfs, ms = _targets(input, list(input.global_shape[2:]), size, scale_factor, recompute_scale_factor)
    local, new_sizes = unwrap(input), []
    for axis, (d, sizes, line) in enumerate(zip(spec.dims, spec.sizes, spec.lines)):
        out_sizes, needs, w = _plan(sizes, ms[d - 2], mode, align_corners, antialias,
                                    None if sfs is None else float(sfs[d - 2]), input.dtype)
        local = gather_along(local, spec, axis, needs)  # this block dim still laid out as spec says
        a = offsets_of(out_sizes)[line.index]
        mine = needs[line.index]
        local = _apply(local, d, w, (a, a + out_sizes[line.index]), (mine[0].start, mine[0].stop) if mine else (0, 0))
        new_sizes.append(out_sizes)
    local = _rest(local, list(spec.dims), outs, sfs, mode, align_corners, antialias)
    return adopt(local, spec.with_sizes(tuple(new_sizes)))
