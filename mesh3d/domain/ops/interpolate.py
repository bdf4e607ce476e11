"""F.interpolate along a domain-sharded dim: nearest, linear/bilinear/trilinear, align_corners both ways.

Usage: automatic for ``F.interpolate(xs, scale_factor=2, mode="bilinear")`` and ``nn.Upsample``.

Interpolation is separable. Along the sharded dim each output row o reads source rows computed
with torch's own formulas (scale = 1/scale_factor when given, else in/out; align_corners maps the
corner rows; nearest uses float32 as torch's CPU kernel does); a rank owns the outputs whose first
source row it holds and gathers the source rows it needs. The other dims are then interpolated
locally by torch with the sharded dim left unchanged (scale 1 there is an exact identity). A bf16/fp16
input is interpolated in float32 and rounded once, as torch's kernels do (two passes rounded in between differed
from one process in a third of the outputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mesh3d.domain.comm.collectives import sum_dtype
from mesh3d.domain.halo.windows import sizes_by_first_index
from mesh3d.domain.ops.conv import spatial_axis
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import unwrap
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.core.plan_cache import plan_cache
from mesh3d.domain.ops.weighted_resample import weighted_interpolate

_LINEAR = ("linear", "bilinear", "trilinear")


@plan_cache(maxsize=256)
def _sources(n: int, m: int, scale_factor, mode: str, align_corners, dtype):
    """(i0, i1, lambda) per output row along one dim, as torch computes them (cached per shape).

    Usage: ``i0, i1, lam = _sources(n, m, 2.0, "bilinear", False, torch.float64)``
    """
    o = torch.arange(m, dtype=torch.float64)
    if mode == "nearest":
        scale = torch.tensor(1.0 / scale_factor if scale_factor else n / m, dtype=torch.float32)
        i0 = torch.clamp(torch.floor(o.to(torch.float32) * scale).long(), max=n - 1)
        return i0, i0, torch.zeros(m, dtype=dtype)
    if align_corners:
        scale = (n - 1) / (m - 1) if m > 1 else 0.0
        src = torch.tensor(scale, dtype=dtype) * o.to(dtype)
    else:
        scale = torch.tensor(1.0 / scale_factor if scale_factor else n / m, dtype=dtype)
        src = torch.clamp(scale * (o.to(dtype) + 0.5) - 0.5, min=0)
    i0 = torch.floor(src).long().clamp(max=n - 1)
    lam = src - i0.to(dtype)
    i1 = torch.where(i0 < n - 1, i0 + 1, i0)
    return i0, i1, lam


def lerp_rows(ext: torch.Tensor, dim: int, i0: Sequence[int], i1: Sequence[int], lam: Sequence[float],
              mode: str) -> torch.Tensor:
    """Output rows along ``dim`` from the gathered source rows ``ext`` (whose first row is source row ``i0[0]``).

    Usage: ``y = lerp_rows(ext, 2, i0[a:b], i1[a:b], lam[a:b], "bilinear")  # plain ints and floats``
    """
    base = i0[0]
    lo = ext.index_select(dim, torch.tensor([i - base for i in i0], device=ext.device))
    if mode == "nearest":
        return lo
    hi = ext.index_select(dim, torch.tensor([i - base for i in i1], device=ext.device))
    w = torch.tensor(lam, dtype=ext.dtype, device=ext.device).view([-1 if i == dim else 1 for i in range(ext.ndim)])
    return lo * (1 - w) + hi * w


@plan_cache(maxsize=256, run_at_trace_time=True)
def row_plan(sizes: tuple[int, ...], m: int, scale_factor, mode: str, align_corners, dtype, me: int):
    """Output sizes per rank, the source rows each rank needs, and this rank's (i0, i1, lambda) as plain data.

    NOTE: plain ints and floats, computed for real even under torch.compile (``run_at_trace_time``): the
    indices are tensor values, which a traced planner could not branch on.
    """
    i0, i1, lam = _sources(sum(sizes), m, scale_factor, mode, align_corners, dtype)
    out_sizes = sizes_by_first_index(sizes, m, lambda row: int(torch.searchsorted(i0, row)))
    bounds = [(a, a + s) for a, s in zip(offsets_of(out_sizes), out_sizes)]
    needs = tuple((Span.rows(int(i0[a]), int(i1[b - 1]) + 1),) if b > a else () for a, b in bounds)
    a, b = bounds[me]
    return out_sizes, needs, tuple(i0[a:b].tolist()), tuple(i1[a:b].tolist()), tuple(lam[a:b].tolist())


@register(F.interpolate)
def _interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False) -> Step:
    nd = input.ndim - 2
    if mode not in ("nearest", *_LINEAR, "bicubic", "area"):
        raise NotImplementedError(f"F.interpolate(mode={mode!r}) is not supported on a domain tensor; use nearest, "
                                  "linear, bilinear, bicubic, trilinear or area")
    sp = spatial_axis("F.interpolate", input, nd)
    if (mode in ("bicubic", "area") or antialias) and sp >= 0 and input.spec.comm.size > 1:
        return weighted_interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias,
                                    sp)

    def whole(t):
        return F.interpolate(t, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)

    if sp < 0:
        return Step(whole, (input,), out=input.spec)
    sizes, n = input.spec.sizes, sum(input.spec.sizes)
    sfs = None if scale_factor is None else (list(scale_factor) if isinstance(scale_factor, (list, tuple))
                                             else [scale_factor] * nd)
    if recompute_scale_factor and sfs is not None:
        size, sfs = [math.floor(g * f) for g, f in zip(input.global_shape[2:], sfs)], None
    # NOTE: a size read from a domain tensor's shape (``size=t.shape[2:]``) means its global length, as in one process.
    outs = [int(n) for n in size] if isinstance(size, (list, tuple)) else \
        ([int(size)] * nd if size is not None else None)
    m = outs[sp] if outs is not None else math.floor(n * sfs[sp])
    if input.spec.comm.size == 1:  # the whole dim is here: torch's own kernel
        return Step(whole, (input,), out=input.spec.with_sizes((m,)))
    acc = sum_dtype(input.dtype)
    out_sizes, needs, i0, i1, lam = row_plan(sizes, m, sfs[sp] if sfs else None, mode, align_corners, acc or input.dtype,
                                              input.spec.comm.index)
    dim = 2 + sp
    local_shape = list(unwrap(input).shape)

    def compute(ext):
        if acc is None or mode == "nearest":
            return interpolate_local(ext)
        return interpolate_local(ext.to(acc)).to(ext.dtype)

    def interpolate_local(ext):
        if not i0:
            shape = list(local_shape)
            shape[dim] = 0
            y = connected_zeros(ext, shape, ext)
        else:
            y = lerp_rows(ext, dim, i0, i1, lam, mode)
        if nd == 1:
            return y
        if outs is not None:
            rest = [y.shape[dim] if i == sp else o for i, o in enumerate(outs)]
            return F.interpolate(y, size=rest, mode=mode, align_corners=align_corners) if y.numel() else \
                connected_zeros(y, [*y.shape[:2], *rest], y)
        rest_sf = [1.0 if i == sp else f for i, f in enumerate(sfs)]
        if y.numel():
            return F.interpolate(y, scale_factor=rest_sf, mode=mode, align_corners=align_corners)
        shape = [*y.shape[:2]] + [0 if i == sp else math.floor(local_shape[2 + i] * f) for i, f in enumerate(sfs)]
        return connected_zeros(y, shape, y)

    return Step(compute, (Rows(input, needs),), out=input.spec.with_sizes(out_sizes))
