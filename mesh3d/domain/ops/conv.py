"""Convolutions (conv1d/2d/3d, conv_transpose1d/2d/3d) and F.pad along a domain-sharded spatial dim.

Usage: automatic for ``nn.Conv2d(...)(xs)`` and ``F.conv2d(xs, w)``; every padding mode of
``nn.Conv*`` works because torch implements non-zero modes as ``F.pad`` + conv, both ruled here.

Conv: the halo planner (``halo.plan_window``) says which input rows each rank needs; they are
gathered (padding rows filled with 0), other spatial dims are padded locally, and the local conv
runs with no padding. Transposed conv: each rank owns the outputs whose source input row it
holds, gathers the input rows that contribute to them, runs the local transposed conv and crops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d._torch_private import PAD_BUILTIN
from mesh3d.domain.halo.windows import extent_map, plan_window, sizes_by_first_index
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.comm.rows import Span, runs_from_indices
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.halo.windows import Extended, Window
from mesh3d.domain.dispatch.step import Partial, Rows, Step
from mesh3d.domain.comm.collectives import scale_grad
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.connected import connected_zeros

__all__ = ["as_tuple", "bias_rows", "kernel_padding", "owned_rows", "pad_local", "pad_pairs", "spatial_axis"]


def as_tuple(v, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


def spatial_axis(op: str, x: DomainTensor, nd: int) -> int:
    """Index of the sharded dim among the op's spatial dims, or -1 when the batch dim is sharded."""
    if x.spec.dim == 0:
        return -1
    sp = x.spec.dim - (x.ndim - nd)
    if sp < 0:
        raise NotImplementedError(
            f"{op}: the domain-sharded dim {x.spec.dim} is a channel dim of a {x.ndim}-D input; "
            f"shard a spatial dim ({x.ndim - nd}..{x.ndim - 1}) instead"
        )
    return sp


def pad_local(t: torch.Tensor, flat: list[int], mode: str = "constant", value=None) -> torch.Tensor:
    """F.pad on a local piece; an empty piece (torch's reflect/replicate refuse those) gets its padded shape."""
    if not any(flat):
        return t
    if t.numel() == 0:
        shape = list(t.shape)
        for i in range(len(flat) // 2):
            shape[-1 - i] += flat[2 * i] + flat[2 * i + 1]
        return connected_zeros(t, shape, t)
    return F.pad(t, flat, mode=mode, value=value)


def pad_pairs(padding, weight_k, dilation, nd: int) -> list[tuple[int, int]]:
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * nd
        if padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, weight_k)]
            return [(t // 2, t - t // 2) for t in totals]
        raise ValueError(f"padding={padding!r} must be 'same', 'valid', an int or a tuple")
    return [(p, p) for p in as_tuple(padding, nd)]


def kernel_padding(pads: list[tuple[int, int]], sp: int, ext: Extended) -> tuple[int, ...] | None:
    """The symmetric per-dim padding for the local kernel (``ext.pad`` on the sharded dim), or None if asymmetric."""
    if any(lo != hi for i, (lo, hi) in enumerate(pads) if i != sp):
        return None
    return tuple(ext.pad if i == sp else lo for i, (lo, hi) in enumerate(pads))


def run_padded(kernel, ext: Extended, pads: list[tuple[int, int]], sp: int, nd: int):
    """Call ``kernel(tensor, padding)``: padding passed to torch where symmetric, else applied by F.pad first."""
    sym = kernel_padding(pads, sp, ext)
    if sym is not None:
        return kernel(ext.tensor, sym)
    flat = [v for i in reversed(range(nd)) for v in ((ext.pad, ext.pad) if i == sp else pads[i])]
    return kernel(F.pad(ext.tensor, flat), (0,) * nd)


def _channels_contracted(func, input: DomainTensor, weight, bias, stride, padding, dilation) -> Step:
    """A conv whose input channels are sharded: this rank's channels against its slice of the weight, a partial result
    the executor sums over the domain (``step.Partial``); the result is replicated (every rank holds it whole)."""
    spec = input.spec
    offset, size, ranks = spec.offset, spec.sizes[spec.comm.index], spec.comm.size

    def part(local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = weight.narrow(1, offset, size)
        if size:
            return func(local, rows, None, stride, padding, dilation, 1)
        # NOTE: torch's conv of zero channels gives zero *output* channels; this rank's share of the sum is zeros
        one = func(local.new_zeros(local.shape[0], 1, *local.shape[2:]), weight.detach()[:, :1], None, stride, padding,
                   dilation, 1)
        return connected_zeros(local, one.shape, local, rows)

    def biased(total: torch.Tensor) -> torch.Tensor:  # every rank adds it alike: 1/D of its gradient each
        return total + scale_grad(bias, 1.0 / ranks).view(1, -1, *([1] * (total.ndim - 2)))

    return Step(part, (input, weight), out=DomainSpec.replicated(spec.comm),
                partial=Partial("sum", None if bias is None else biased))


def _conv_rule(func, nd: int):
    name = f"torch.nn.functional.conv{nd}d"

    def rule(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Step:
        if isinstance(weight, DomainTensor) or isinstance(bias, DomainTensor):
            raise NotImplementedError(f"{name}: the weight and bias must be plain (replicated) tensors")
        # NOTE: dim 1 is the channels of a batched input only; an unbatched (C, H, W)'s dim 1 is spatial (halos)
        if input.spec.dim == 1 and input.ndim == nd + 2 and groups == 1:  # channels sharded (MLP-Mixer): a contraction
            return _channels_contracted(func, input, weight, bias, stride, padding, dilation)
        sp = spatial_axis(name, input, nd)
        if sp < 0:
            return Step(func, (input, weight, bias, stride, padding, dilation, groups), out=input.spec)
        stride, dilation = as_tuple(stride, nd), as_tuple(dilation, nd)
        ks = tuple(weight.shape[2:])
        pads = pad_pairs(padding, ks, dilation, nd)
        plan = plan_window(input.spec.sizes, ks[sp], stride[sp], dilation[sp], *pads[sp])
        mine = plan.out_sizes[input.spec.comm.index]

        def empty(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            shape = [t.shape[0], weight.shape[0]]
            for i in range(nd):
                length = t.shape[2 + i] + (0 if i == sp else sum(pads[i]))
                shape.append(0 if i == sp else (length - dilation[i] * (ks[i] - 1) - 1) // stride[i] + 1)
            return connected_zeros(t, shape, t, weight, bias)

        if dilation[sp] * (ks[sp] - 1) == 0 and stride[sp] == 1 and pads[sp] == (0, 0):
            # NOTE: a window that moves nothing (a 1x1 kernel along the sharded dim): torch's kernel on the shard, as
            # it is, with no exchange to plan. The choice reads only what every rank shares, so all take the same.
            def direct(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
                if mine == 0:
                    return empty(t, weight, bias)
                return func(t, weight, bias, stride, padding, dilation, groups)

            return Step(direct, (input, weight, bias), out=input.spec)

        # NOTE: the weight and bias are the step's arguments, not values its function closes over: the step holds
        # nothing but the call's tensors, so a later call of the signature binds its own (``dispatch.kept_steps``)
        def compute(ext: Extended, weight: torch.Tensor, bias: torch.Tensor | None):
            if mine == 0:
                return empty(ext.tensor, weight, bias)
            return run_padded(lambda t, p: func(t, weight, bias, stride, p, dilation, groups), ext, pads, sp, nd)

        # The kernel may run on row strips (the padding of the sharded dim is then in the strips' rows).
        overlap = (dilation[sp] * (ks[sp] - 1) + 1, stride[sp])
        return Step(compute, (Window(input, plan, overlap=overlap), weight, bias),
                    out=input.spec.with_sizes(plan.out_sizes))

    return rule


def transpose_plan(sizes: tuple[int, ...], m: int, s: int, p: int, d: int, k: int):
    """A transposed conv along one sharded dim: each rank's output sizes, the input rows it reads, their first.

    Usage: ``out_sizes, needs, starts = transpose_plan(sizes, m, stride, padding, dilation, kernel)``

    Output o is owned by the rank holding its "source" input row floor((o + p) / s).
    """
    n = sum(sizes)
    out_sizes = sizes_by_first_index(sizes, m, lambda row: row * s - p)
    needs, starts = [], []
    for a, size in zip(offsets_of(out_sizes), out_sizes):
        i0 = max(0, -(-(a + p - d * (k - 1)) // s))
        i1 = min(n - 1, (a + size - 1 + p) // s)
        needs.append((Span.rows(i0, i1 + 1),) if size and i0 <= i1 else ())
        starts.append(i0)
    return out_sizes, tuple(needs), starts


def bias_rows(y: torch.Tensor, dim: int, before: int, after: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``y`` with ``before`` and ``after`` rows along ``dim`` that hold only the bias (zeros without one)."""
    def rows(n: int) -> torch.Tensor:
        shape = [*y.shape[:dim], n, *y.shape[dim + 1:]]
        fill = y.new_zeros(shape)
        return fill if bias is None else fill + bias.view(1, -1, *([1] * (y.ndim - 2)))

    return torch.cat([rows(before), y, rows(after)], dim)


def owned_rows(y: torch.Tensor, dim: int, first: int, size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` output rows a rank owns, from ``y`` computed on the input rows it read, whose first row sits at
    ``first`` among them (negative: ``y`` starts before them); owned rows no input reaches hold only the bias (zeros
    without one). A transposed window's last step (conv_transpose, F.fold)."""
    # NOTE: rows of y past my last output row belong to the next rank; with first > 0 (my first rows reached by no
    # input) they start sooner, at size - first (an empty shard before me makes that happen)
    y = y.narrow(dim, -first, min(size, y.shape[dim] + first)) if first <= 0 else \
        y.narrow(dim, 0, min(y.shape[dim], size - first))
    short = size - y.shape[dim] - max(first, 0)
    if first > 0 or short > 0:
        y = bias_rows(y, dim, max(first, 0), short, bias)
    return y


def _conv_transpose_rule(func, nd: int):
    name = f"torch.nn.functional.conv_transpose{nd}d"

    def rule(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1) -> Step:
        sp = spatial_axis(name, input, nd)
        args = (input, weight, bias, stride, padding, output_padding, groups, dilation)
        if sp < 0:
            return Step(func, args, out=input.spec)
        stride, padding, dilation = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
        output_padding = as_tuple(output_padding, nd)
        s, p, d, k = stride[sp], padding[sp], dilation[sp], weight.shape[2 + sp]
        sizes, n = input.spec.sizes, sum(input.spec.sizes)
        m = (n - 1) * s - 2 * p + d * (k - 1) + output_padding[sp] + 1
        if input.spec.comm.size == 1:  # nothing to exchange: torch's kernel on the shard, unchanged
            return Step(func, args, out=input.spec.with_sizes((m,)))
        out_sizes, needs, starts = transpose_plan(sizes, m, s, p, d, k)
        me = input.spec.comm.index
        a, size = offsets_of(out_sizes)[me], out_sizes[me]
        local_pad = tuple(0 if i == sp else padding[i] for i in range(nd))
        local_op = tuple(0 if i == sp else output_padding[i] for i in range(nd))

        def compute(ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):  # NOTE: as conv's (above)
            if needs[me]:
                # NOTE: the bias inside torch's kernel, as one process adds it: one rounding in bf16/fp16, not two.
                y = func(ext, weight, bias, stride, local_pad, local_op, groups, dilation)
                return owned_rows(y, 2 + sp, starts[me] * s - p - a, size, bias)
            else:  # no contributing input rows: only the bias (or an empty shard)
                ref = func(ext.narrow(2 + sp, 0, 0).new_zeros([*ext.shape[:2 + sp], 1, *ext.shape[3 + sp:]]),
                           weight, None, stride, local_pad, local_op, groups, dilation)
                shape = list(ref.shape)
                shape[2 + sp] = size
                y = connected_zeros(ref, shape, ext, weight)
            if bias is not None:
                y = y + bias.view(1, -1, *([1] * nd))
            return y

        return Step(compute, (Rows(input, tuple(needs)), weight, bias), out=input.spec.with_sizes(out_sizes))

    return rule


for _nd, _f in ((1, F.conv1d), (2, F.conv2d), (3, F.conv3d)):
    register(_f)(_conv_rule(_f, _nd))
for _nd, _f in ((1, F.conv_transpose1d), (2, F.conv_transpose2d), (3, F.conv_transpose3d)):
    register(_f)(_conv_transpose_rule(_f, _nd))


def _source_row(g: int, n: int, mode: str) -> int:
    if 0 <= g < n:
        return g
    if mode == "constant":
        return -1
    if mode == "reflect":
        return -g if g < 0 else 2 * (n - 1) - g
    if mode == "replicate":
        return min(max(g, 0), n - 1)
    if mode == "circular":
        return g % n
    raise ValueError(f"F.pad mode={mode!r} is not supported on a domain-sharded dim")


def padded_rows(lo: int, hi: int, n: int, pl: int, mode: str):
    """Runs of source rows for padded rows [lo, hi): real rows as one run, the padding row by row (O(pad))."""
    left = runs_from_indices(_source_row(g - pl, n, mode) for g in range(lo, min(hi, pl)))
    middle = extent_map(max(lo, pl) - pl, min(hi, pl + n) - pl - 1, n) if max(lo, pl) < min(hi, pl + n) else ()
    right = runs_from_indices(_source_row(g - pl, n, mode) for g in range(max(lo, pl + n), hi))
    return left + middle + right


@register(F.pad, PAD_BUILTIN)
def _pad(input, pad, mode="constant", value=None) -> Step:
    dim = input.spec.dim
    pos = input.ndim - 1 - dim  # which (left, right) pair of ``pad`` belongs to the sharded dim
    pad = list(pad)
    pl, pr = (pad[2 * pos], pad[2 * pos + 1]) if 2 * pos + 1 < len(pad) else (0, 0)
    if (pl, pr) == (0, 0):
        return Step(lambda t: pad_local(t, pad, mode, value), (input,), out=input.spec)
    sizes, n = input.spec.sizes, sum(input.spec.sizes)
    if mode in ("reflect", "circular") and (pl >= n + (mode == "circular") or pr >= n + (mode == "circular")):
        raise ValueError(f"F.pad mode={mode!r}: padding ({pl}, {pr}) too large for the sharded dim of length {n}")
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise ValueError(f"F.pad mode={mode!r} is not supported on a domain-sharded dim")
    new_sizes = list(sizes)
    first = next(i for i, s in enumerate(sizes) if s > 0)
    last = max(i for i, s in enumerate(sizes) if s > 0)
    new_sizes[first] += pl
    new_sizes[last] += pr
    if min(new_sizes) < 0:
        raise ValueError(
            f"F.pad: cropping ({pl}, {pr}) along the sharded dim would remove more than the edge shards hold "
            f"(sizes {sizes})"
        )
    if input.spec.comm.size == 1:  # the whole dim is here: torch's own pad
        return Step(lambda t: F.pad(t, pad, mode, value), (input,), out=input.spec.with_sizes(tuple(new_sizes)))
    needs = tuple(padded_rows(o, o + s, n, pl, mode) for o, s in zip(offsets_of(new_sizes), new_sizes))
    rest = list(pad)
    rest[2 * pos] = rest[2 * pos + 1] = 0
    return Step(lambda ext: pad_local(ext, rest, mode, value),
                (Rows(input, needs, 0.0 if value is None else float(value)),),
                out=input.spec.with_sizes(tuple(new_sizes)))
