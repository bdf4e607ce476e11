"""Sliding windows along the sharded dim, as window ops with the halo planner's ownership: ``Tensor.unfold``;
``F.unfold`` (im2col) and its transpose ``F.fold`` (col2im, patch-based models and their hand-written convolutions);
and ``movedim``, which usually follows ``Tensor.unfold`` (the window dim moved next to the rows).

Usage: automatic: ``x.unfold(1, 3, 1)`` of a tensor sharded along dim 1 (local-attention's look-around of windows)
gives each rank the windows whose centre row it holds; the rows a window reads beyond this rank's come from their
owners (at most ``size - 1`` of them), as for a convolution of kernel ``size`` and stride ``step``.
``F.unfold(xs, 3, padding=1)`` of an image sharded along its height gives each rank the columns of the patches it
owns so (the positions dim, whole rows of patches, sharded); ``F.fold`` of such columns gives the image back sharded
along its height, each output row summed from the patches that cover it, wherever they live.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.halo.windows import Extended, Window, plan_window, window_output_length
from mesh3d.domain.ops.conv import as_tuple, owned_rows, run_padded, transpose_plan

__all__: list[str] = []


@register(torch.Tensor.unfold)
def _unfold(input, dimension, size, step) -> Step:
    spec = input.spec
    d = dimension % input.ndim
    if d != spec.dim:
        return Step(lambda t: t.unfold(d, size, step), (input,), out=spec)
    plan = plan_window(spec.sizes, size, step, 1, 0, 0)
    mine = plan.out_sizes[spec.comm.index]

    def compute(ext: Extended):
        if mine == 0:  # no window here: an empty result that still reaches the shard in backward
            shape = [*ext.tensor.shape, size]
            shape[d] = 0
            return connected_zeros(ext.tensor, shape, ext.tensor)
        return ext.tensor.unfold(d, size, step)

    return Step(compute, (Window(input, plan),), out=spec.with_sizes(plan.out_sizes))


@register(F.unfold)
def _im2col(input, kernel_size, dilation=1, padding=0, stride=1) -> Step:
    """``F.unfold`` of a ``([N,] C, H, W)`` image: sharded along H, the positions dim (whole rows of patches) is sharded
    as the patches' rows are owned; sharded along C, the patch-values dim (``C`` outermost) by the channels."""
    spec, ks, dil, pad, st = input.spec, *(as_tuple(v, 2) for v in (kernel_size, dilation, padding, stride))
    args = (input, kernel_size, dilation, padding, stride)
    channels, rows = input.ndim - 3, input.ndim - 2  # the channel and height dims (the output's dims there too)
    if spec.dim < channels:  # the batch
        return Step(F.unfold, args, out=spec)
    if spec.dim == channels:
        return Step(F.unfold, args, out=spec.with_sizes(tuple(c * ks[0] * ks[1] for c in spec.sizes)))
    if spec.dim != rows:
        raise NotImplementedError(
            f"torch.nn.functional.unfold: the tensor is sharded along its width (dim {spec.dim}), whose patches "
            f"interleave with every other rank's in the positions dim; shard the height (dim {rows}) instead, or "
            "call .full_tensor() first")
    width = window_output_length(input.shape[-1], ks[1], st[1], dil[1], pad[1], pad[1])
    plan = plan_window(spec.sizes, ks[0], st[0], dil[0], pad[0], pad[0])
    mine = plan.out_sizes[spec.comm.index]

    def compute(ext: Extended):
        if mine == 0:  # no patch here: empty columns that still reach the shard in backward
            return connected_zeros(ext.tensor, [*ext.tensor.shape[:channels], ext.tensor.shape[channels] * ks[0] * ks[1], 0],
                                   ext.tensor)
        return run_padded(lambda t, p: F.unfold(t, ks, dil, p, st), ext, [(pad[0], pad[0]), (pad[1], pad[1])], 0, 2)

    return Step(compute, (Window(input, plan),), out=spec.with_sizes(tuple(r * width for r in plan.out_sizes)))


@register(F.fold)
def _col2im(input, output_size, kernel_size, dilation=1, padding=0, stride=1) -> Step:
    """``F.fold`` of ``([N,] C*kh*kw, L)`` columns sharded along L in whole rows of patches: a transposed window along
    the output's height, each rank summing the patches that reach the rows it owns (``transpose_plan``)."""
    spec, size, ks, dil, pad, st = input.spec, *(as_tuple(v, 2) for v in (output_size, kernel_size, dilation, padding,
                                                                          stride))
    args = (input, output_size, kernel_size, dilation, padding, stride)
    positions = input.ndim - 1
    if spec.dim < positions - 1:  # the batch
        return Step(F.fold, args, out=spec)
    across = window_output_length(size[1], ks[1], st[1], dil[1], pad[1], pad[1])  # patches per row of patches
    if spec.dim != positions or any(n % across for n in spec.sizes):
        raise NotImplementedError(
            f"torch.nn.functional.fold: the columns must be sharded along their positions (dim {positions}) in whole "
            f"rows of patches (multiples of {across}, as F.unfold of an image sharded along its height gives), got "
            f"sizes {spec.sizes} along dim {spec.dim}; call .full_tensor() first")
    rows = tuple(n // across for n in spec.sizes)
    out_sizes, needs, starts = transpose_plan(rows, size[0], st[0], pad[0], dil[0], ks[0])
    me = spec.comm.index
    first_row, height = offsets_of(out_sizes)[me], out_sizes[me]
    lead = input.shape[:-2]

    def compute(cols: torch.Tensor) -> torch.Tensor:
        channels = cols.shape[-2] // (ks[0] * ks[1])
        if not needs[me]:  # no patch reaches my rows (or I own none): zeros
            return connected_zeros(cols, [*lead, channels, height, size[1]], cols)
        count = cols.shape[-1] // across
        reach = (count - 1) * st[0] + dil[0] * (ks[0] - 1) + 1  # the rows my patches cover, from their first
        y = F.fold(cols, (reach, size[1]), ks, dil, (0, pad[1]), st)
        return owned_rows(y, y.ndim - 2, starts[me] * st[0] - pad[0] - first_row, height)

    needs_cols = tuple((Span.rows(n[0].start * across, n[0].stop * across),) if n else () for n in needs)
    return Step(compute, (Rows(input, needs_cols),), out=spec.with_sizes(out_sizes, dim=input.ndim - 1))


def _movedim(input, source, destination):
    """``movedim``/``moveaxis`` as the permutation it is (on slabs and strided slabs, the sharded dim moving too)."""
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    n = input.ndim
    src, dst = [s % n for s in src], [t % n for t in dst]
    order = [None] * n
    for s, t in zip(src, dst):
        order[t] = s
    rest = iter(d for d in range(n) if d not in src)
    order = [o if o is not None else next(rest) for o in order]
    spec = input.spec
    return Step(lambda t: t.permute(order), (input,), out=spec.with_sizes(spec.sizes, dim=order.index(spec.dim)))


for _f in (torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis):
    register(_f)(_movedim)
