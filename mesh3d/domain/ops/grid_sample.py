"""``F.grid_sample`` of a field sharded along a spatial dim, with the grid sharded like the output (warps,
semi-Lagrangian advection, regridding): each rank fetches the source rows its grid reaches, wherever they live.

Usage: automatic, through torch::

    xs = domain.shard(field, dim=2)                  # (N, C, H, W), sharded along H
    gs = domain.shard(grid, dim=1)                   # (N, Ho, Wo, 2): each rank the grid of the output rows it owns
    ys = F.grid_sample(xs, gs, align_corners=False)  # (N, C, Ho, Wo), sharded along Ho as the grid is
    # volumes alike: (N, C, D, H, W) sharded along D, the grid (N, Do, Ho, Wo, 3) along Do

Where a rank's grid points reach is data: every rank reads its grid's extent along the sharded dim (the taps its
interpolation reads, border clipping applied) and declares it (``Reached``): the executor sends the extents round in
one small all-reduce, and the rows travel through the exchange (the backward returns their gradient to the owners). The interpolation then runs on
the fetched rows by torch's own formulas with global indices: the unnormalization is the kernel's (the CPU kernel's
on CPU, the CUDA kernel's on CUDA), so a grid point on an exact row (an identity warp) takes the same taps, and its
gradient the same side, as in one process. Bilinear (trilinear on volumes) and nearest with zero, border or
reflection padding, 4-D and 5-D inputs sharded along any spatial dim; bicubic on 4-D inputs (16 taps from one row
before the point's to two after, each tap's index padded on its own as torch pads it).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.tensor import DomainTensor, unwrap
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.step import Reached, Step

__all__: list[str] = []

_NAME = "torch.nn.functional.grid_sample"


def _fma(a: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """``a * b + c`` rounded once, as a fused multiply-add: exact in float64 for narrower dtypes (the product of a
    24-bit and a small integer's half fits), by Dekker's two-product and Knuth's two-sum in float64 itself."""
    if a.dtype != torch.float64:
        return (a.double() * b + c).to(a.dtype)
    split = 134217729.0  # 2**27 + 1: Veltkamp's splitting of a double into two halves
    p = a * b
    big = a * split
    a_hi = big - (big - a)
    a_lo = a - a_hi
    b_hi = b * split - (b * split - b)
    b_lo = b - b_hi
    err = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo  # a * b == p + err exactly
    total = p + c
    back = total - p
    carry = (p - (total - back)) + (c - back)  # p + c == total + carry exactly
    return total + (carry + err)


def _unnormalize(coord: torch.Tensor, size: int, align_corners: bool, kernel: str) -> torch.Tensor:
    """A grid coordinate in [-1, 1] as a position along a dim of ``size``, rounded as torch's kernel rounds it.

    NOTE: the last bit decides which row a point on an exact row floors to, so which side its gradient takes (an
    identity grid is all such points). The vectorized 2-D CPU kernel (GridSamplerKernel.cpp) computes
    ``fmadd(coord + 1, size / 2, -0.5)`` without align_corners and ``(coord + 1) * ((size - 1) / 2)`` with it; the
    scalar 3-D CPU kernel ``((coord + 1) * size - 1) / 2`` and ``(coord + 1) / 2 * (size - 1)`` (both checked here
    point by point against torch 2.13's gradients on identity grids, 2 to 120 rows, float32 and float64: float32
    tells the formulas apart); the CUDA kernel's ``((coord + 1) * size - 1) / 2`` is taken as nvcc contracts it (a
    fused multiply-add; not measured here)."""
    shifted = coord + 1
    if kernel == "cuda":
        return _fma(shifted, float(size), -1.0) / 2 if not align_corners else shifted / 2 * (size - 1)
    if kernel == "cpu3d":
        return (shifted * size - 1) / 2 if not align_corners else shifted / 2 * (size - 1)
    return _fma(shifted, size / 2, -0.5) if not align_corners else shifted * ((size - 1) / 2)


def _border(pos: torch.Tensor, size: int) -> torch.Tensor:
    """Clipped to [0, size - 1], with the gradient 0 at and beyond the ends (torch's ``clip_coordinates_set_grad``)."""
    return torch.where(pos <= 0, pos.new_zeros(()), torch.where(pos >= size - 1, pos.new_full((), size - 1.0), pos))


def _reflect(pos: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """Reflected into the input, as torch's ``reflect_coordinates``: about the end rows' centres with
    ``align_corners``, about their outer edges without; the gradient's sign flips with each reflection."""
    low, high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
    if low == high:  # one row, corners aligned: every point is that row
        return pos * 0
    least, span = low / 2, (high - low) / 2
    distance = (pos - least).abs()
    extra = torch.fmod(distance, span)
    flips = torch.floor(distance / span)
    return torch.where(flips % 2 == 0, extra + least, span - extra + least)


def _positions(grid: torch.Tensor, shape: tuple[int, ...], mode_args: tuple[str, bool, str],
               mode: str = "bilinear") -> list[torch.Tensor]:
    """The positions of ``grid``'s points along each of the input's spatial dims, in the input's order (the grid's
    last dim lists them the other way round: x, the last dim, first), padding applied (reflection, then the clip
    torch applies after it); bicubic pads each tap instead (``_bicubic_taps``)."""
    padding, align_corners, kernel = mode_args
    k = len(shape)
    pos = [_unnormalize(grid[..., k - 1 - j], shape[j], align_corners, kernel) for j in range(k)]
    if mode == "bicubic":
        return pos
    if padding == "reflection":
        pos = [_reflect(p, size, align_corners) for p, size in zip(pos, shape)]
    return [_border(p, size) for p, size in zip(pos, shape)] if padding in ("border", "reflection") else pos


_A = -0.75  # the cubic convolution's parameter in torch's bicubic kernels


def _cubic_weights(t: torch.Tensor) -> list[torch.Tensor]:
    """The weights of the taps at -1, 0, 1, 2 from the floor, at fraction ``t`` (torch's ``get_cubic_upsample_coefficients``)."""
    def near(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
        return ((_A + 2) * x - (_A + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
        return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _bicubic_taps(pos: list[torch.Tensor], shape: tuple[int, ...], padding: str,
                  align_corners: bool) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """The 16 taps of bicubic sampling at unpadded positions: each tap's index padded on its own (border clips it,
    reflection reflects then clips it), as torch's ``get_value_bounded``; its weight the product of the two cubic
    weights (the gradient reaches the grid through the fractions)."""
    low = [p.floor() for p in pos]
    weights = [_cubic_weights(p - q) for p, q in zip(pos, low)]
    taps = []
    for i, j in itertools.product(range(4), repeat=2):  # rows (y, the first spatial dim), then columns
        index = [low[0] + (i - 1), low[1] + (j - 1)]
        if padding == "reflection":
            index = [_reflect(k, size, align_corners) for k, size in zip(index, shape)]
        if padding in ("border", "reflection"):
            index = [_border(k, size) for k, size in zip(index, shape)]
        taps.append((index, weights[0][i] * weights[1][j]))
    return taps


def _taps(pos: list[torch.Tensor], mode: str, cubic: tuple = ()) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """(index along each spatial dim, weight) of each tap, in torch's order (2-D: nw, ne, sw, se; 3-D: tnw ... bse);
    bicubic: ``cubic`` is (shape, padding, align_corners)."""
    if mode == "bicubic":
        return _bicubic_taps(pos, *cubic)
    if mode == "nearest":
        # round: half to even, as the kernels' nearbyint; the weight 1 keeps the grid in the graph (its gradient 0)
        return [([torch.round(p) for p in pos], pos[0] * 0 + 1)]
    low = [p.floor() for p in pos]
    frac = [p - q for p, q in zip(pos, low)]  # the fractions: their gradient is the grid's
    taps = []
    for offsets in itertools.product((0, 1), repeat=len(pos)):
        weight = None
        for f, o in zip(reversed(frac), reversed(offsets)):  # NOTE: x's factor first, as the kernels multiply
            factor = f if o else 1 - f
            weight = factor if weight is None else weight * factor
        assert weight is not None
        taps.append(([q + o for q, o in zip(low, offsets)], weight))
    return taps


def _inside(index: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    inside = (index[0] >= 0) & (index[0] <= shape[0] - 1)
    for i, size in zip(index[1:], shape[1:]):
        inside = inside & (i >= 0) & (i <= size - 1)
    return inside


def _extent(pos: list[torch.Tensor], mode: str, shape: tuple[int, ...], axis: int, cubic: tuple = ()) -> tuple[int, int]:
    """The first and last input index along spatial dim ``axis`` any in-bounds tap reads; (0, -1): none."""
    lo, hi = shape[axis], -1
    with torch.no_grad():
        for index, _ in _taps([p.detach() for p in pos], mode, cubic):
            along = index[axis][_inside(index, shape)]
            if along.numel():
                lo, hi = min(lo, int(along.min())), max(hi, int(along.max()))
    return (lo, hi) if hi >= lo else (0, -1)


def _sample(part: torch.Tensor, first: int, pos: list[torch.Tensor], mode: str, shape: tuple[int, ...],
            axis: int, cubic: tuple = ()) -> torch.Tensor:
    """The interpolation of the input's indices [first, first + part.shape[2 + axis]) along spatial dim ``axis`` held
    in ``part`` (N, C, *local sizes), at the positions (N, *output sizes): (N, C, *output sizes); taps outside the
    input read zero."""
    n, c = part.shape[:2]
    local = part.shape[2:]
    strides = [math.prod(local[j + 1:]) for j in range(len(local))]
    flat = part.flatten(2)
    out = None
    for index, weight in _taps(pos, mode, cubic):
        inside = _inside(index, shape)
        linear = sum((i - first if j == axis else i) * stride for j, (i, stride) in enumerate(zip(index, strides)))
        gather = torch.where(inside, linear, 0).long().view(n, 1, -1).expand(n, c, -1)
        value = flat.gather(2, gather).view(n, c, *pos[0].shape[1:]) * inside.unsqueeze(1).to(part.dtype)
        term = value * weight.unsqueeze(1)
        out = term if out is None else out + term
    assert out is not None
    return out


def _refuse_unless_supported(input, grid, mode: str, padding_mode: str) -> None:
    if mode not in ("bilinear", "nearest", "bicubic") or padding_mode not in ("zeros", "border", "reflection") \
            or input.ndim not in (4, 5) or (mode == "bicubic" and input.ndim != 4):
        raise NotImplementedError(
            f"{_NAME} on a domain-sharded input: mode={mode!r}, padding_mode={padding_mode!r} on a {input.ndim}-D input "
            "has no rule (the rule takes 4-D and 5-D inputs, bilinear or nearest, bicubic on 4-D ones, zeros, border or "
            "reflection padding); call .full_tensor() on the input first")
    if not isinstance(grid, DomainTensor) or grid.spec.dim is None:
        raise NotImplementedError(
            f"{_NAME}: the input is sharded along dim {input.spec.dim} and the grid is whole; shard the grid like the "
            "output (domain.shard(grid, dim=1): each rank the grid points of the output rows it owns), or call "
            ".full_tensor() on the input first")
    if grid.spec.dim == grid.ndim - 1 or grid.spec.outer > 1 or input.spec.outer > 1:
        raise NotImplementedError(f"{_NAME}: the grid is sharded along its coordinates (dim {grid.spec.dim}) or strided; "
                                  f"shard it along an output dim (1 to {grid.ndim - 2}), or call .full_tensor() first")


@register(F.grid_sample)
def _grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None) -> Step:
    align = bool(align_corners)
    args = (mode, padding_mode, align)
    if not isinstance(input, DomainTensor) or input.spec.dim is None:  # a whole input: each rank its grid's points
        out = _output_spec(grid) if isinstance(grid, DomainTensor) else input.spec
        return Step(lambda x, g: F.grid_sample(x, g, *args), (input, grid), out=out)
    if input.spec.dim == 0 and isinstance(grid, DomainTensor) and grid.spec.dim == 0 \
            and grid.spec.sizes == input.spec.sizes:  # both by samples
        return Step(lambda x, g: F.grid_sample(x, g, *args), (input, grid), out=input.spec)
    if input.spec.dim < 2:
        raise NotImplementedError(
            f"{_NAME}: the input is sharded along dim {input.spec.dim}; shard a spatial dim (2 and up), or the batch "
            "of both the input and the grid alike")
    _refuse_unless_supported(input, grid, mode, padding_mode)
    axis = input.spec.dim - 2
    shape = tuple(input.shape[2:])  # global sizes
    local_grid = unwrap(grid)
    kernel = "cuda" if local_grid.device.type == "cuda" else "cpu3d" if input.ndim == 5 else "cpu2d"
    cubic = (shape, padding_mode, align) if mode == "bicubic" else ()
    pos = _positions(local_grid, shape, (padding_mode, align, kernel), mode)
    lo, hi = _extent(pos, mode, shape, axis, cubic)  # data: the executor tells the peers (``Reached``)

    def compute(part: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if hi < lo:  # no point reads a row of the input: zeros that still reach both in backward
            return connected_zeros(part, [part.shape[0], part.shape[1], *g.shape[1:-1]], part, g)
        return _sample(part, lo, _positions(g, shape, (padding_mode, align, kernel), mode), mode, shape, axis, cubic)

    return Step(compute, (Reached(input, lo, hi), grid), out=_output_spec(grid))


def _output_spec(grid: DomainTensor):
    """The output's layout: the grid's, its dim k (1 or 2) the output's dim k + 1; the batch dim stays."""
    spec = grid.spec
    return spec if spec.dim in (None, 0) else spec.with_sizes(spec.sizes, dim=spec.dim + 1)
