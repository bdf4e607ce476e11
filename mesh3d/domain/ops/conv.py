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

from mesh3d.domain.exchange import build_plan, gather_rows
from mesh3d.domain.halo import owners_by_position, plan_window, sizes_from_owners
from mesh3d.domain.registry import register
from mesh3d.domain.split import offsets_of
from mesh3d.domain.tensor import DomainTensor, adopt, unwrap

__all__ = ["gather_window", "spatial_axis"]


def _tuple(v, n: int) -> tuple[int, ...]:
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


def _weight_connected_zeros(x: torch.Tensor, shape: list[int], *params) -> torch.Tensor:
    """Zeros of ``shape`` that still reach ``params`` in autograd.

    Why: the halo exchange's backward is point-to-point, so *every* rank must run it, including a
    rank whose own output is empty; and parameters must get a (zero) .grad on every rank so that
    summing gradients over the domain sees the same set of tensors everywhere.
    """
    out = x.new_zeros(shape)
    for p in params:
        if p is not None:
            out = out + p.sum() * 0
    return out


def pad_local(t: torch.Tensor, flat: list[int], mode: str = "constant", value=None) -> torch.Tensor:
    """F.pad on a local piece; an empty piece (torch's reflect/replicate refuse those) gets its padded shape."""
    if not any(flat):
        return t
    if t.numel() == 0:
        shape = list(t.shape)
        for i in range(len(flat) // 2):
            shape[-1 - i] += flat[2 * i] + flat[2 * i + 1]
        return _weight_connected_zeros(t, shape, t)
    return F.pad(t, flat, mode=mode, value=value)


def gather_window(x: DomainTensor, plan_needs, fill: float = 0.0) -> torch.Tensor:
    comm = x.spec.comm
    plan = build_plan(x.spec.sizes, plan_needs, comm.index)
    return gather_rows(unwrap(x), x.spec.dim, plan, comm, fill)


def _pad_pairs(padding, weight_k, dilation, nd: int) -> list[tuple[int, int]]:
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * nd
        if padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, weight_k)]
            return [(t // 2, t - t // 2) for t in totals]
        raise ValueError(f"padding={padding!r} must be 'same', 'valid', an int or a tuple")
    return [(p, p) for p in _tuple(padding, nd)]


def _conv_rule(func, nd: int):
    name = f"torch.nn.functional.conv{nd}d"

    def rule(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if isinstance(weight, DomainTensor) or isinstance(bias, DomainTensor):
            raise NotImplementedError(f"{name}: the weight and bias must be plain (replicated) tensors")
        sp = spatial_axis(name, input, nd)
        if sp < 0:
            return adopt(func(unwrap(input), weight, bias, stride, padding, dilation, groups), input.spec)
        stride, dilation = _tuple(stride, nd), _tuple(dilation, nd)
        ks = tuple(weight.shape[2:])
        pads = _pad_pairs(padding, ks, dilation, nd)
        plan = plan_window(input.spec.sizes, ks[sp], stride[sp], dilation[sp], *pads[sp])
        ext = gather_window(input, plan.needs)
        flat = [v for i in reversed(range(nd)) for v in ((0, 0) if i == sp else pads[i])]
        ext = pad_local(ext, flat)
        mine = plan.out_sizes[input.spec.comm.index]
        if mine == 0:
            shape = [ext.shape[0], weight.shape[0]]
            for i in range(nd):
                length = ext.shape[2 + i]
                shape.append(0 if i == sp else (length - dilation[i] * (ks[i] - 1) - 1) // stride[i] + 1)
            y = _weight_connected_zeros(ext, shape, ext, weight, bias)
        else:
            y = func(ext, weight, bias, stride, 0, dilation, groups)
        return adopt(y, input.spec.with_sizes(plan.out_sizes))

    return rule


def _conv_transpose_rule(func, nd: int):
    name = f"torch.nn.functional.conv_transpose{nd}d"

    def rule(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        sp = spatial_axis(name, input, nd)
        if sp < 0:
            return adopt(func(unwrap(input), weight, bias, stride, padding, output_padding, groups, dilation), input.spec)
        stride, padding, dilation = _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd)
        output_padding = _tuple(output_padding, nd)
        s, p, d, k = stride[sp], padding[sp], dilation[sp], weight.shape[2 + sp]
        sizes, n = input.spec.sizes, sum(input.spec.sizes)
        m = (n - 1) * s - 2 * p + d * (k - 1) + output_padding[sp] + 1
        # Output o is owned by the rank holding its "source" input row floor((o + p) / s).
        out_sizes = sizes_from_owners(owners_by_position(sizes, [(o + p) // s for o in range(m)]), len(sizes))
        needs, starts = [], []
        for a, size in zip(offsets_of(out_sizes), out_sizes):
            b = a + size
            i0 = max(0, -(-(a + p - d * (k - 1)) // s))
            i1 = min(n - 1, (b - 1 + p) // s)
            needs.append(tuple(range(i0, i1 + 1)) if size and i0 <= i1 else ())
            starts.append(i0)
        ext = gather_window(input, tuple(needs))
        me = input.spec.comm.index
        a, size = offsets_of(out_sizes)[me], out_sizes[me]
        local_pad = tuple(0 if i == sp else padding[i] for i in range(nd))
        local_op = tuple(0 if i == sp else output_padding[i] for i in range(nd))
        if needs[me]:
            y = func(ext, weight, None, stride, local_pad, local_op, groups, dilation)
            g0 = starts[me] * s - p  # global output index of local row 0
            flat = [0] * (2 * nd)
            flat[2 * (nd - 1 - sp)] = g0 - a
            flat[2 * (nd - 1 - sp) + 1] = (a + size - 1) - (g0 + y.shape[2 + sp] - 1)
            y = F.pad(y, flat)
        else:  # no contributing input rows: only the bias (or an empty shard)
            ref = func(ext.narrow(2 + sp, 0, 0).new_zeros([*ext.shape[:2 + sp], 1, *ext.shape[3 + sp:]]), weight,
                       None, stride, local_pad, local_op, groups, dilation)
            shape = list(ref.shape)
            shape[2 + sp] = size
            y = _weight_connected_zeros(ref, shape, ext, weight)
        if bias is not None:
            y = y + bias.view(1, -1, *([1] * nd))
        return adopt(y, input.spec.with_sizes(out_sizes))

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


@register(F.pad)
def _pad(input, pad, mode="constant", value=None):
    dim = input.spec.dim
    pos = input.ndim - 1 - dim  # which (left, right) pair of ``pad`` belongs to the sharded dim
    pad = list(pad)
    pl, pr = (pad[2 * pos], pad[2 * pos + 1]) if 2 * pos + 1 < len(pad) else (0, 0)
    if (pl, pr) == (0, 0):
        return adopt(pad_local(unwrap(input), pad, mode, value), input.spec)
    sizes, n = input.spec.sizes, sum(input.spec.sizes)
    if mode in ("reflect", "circular") and (pl >= n + (mode == "circular") or pr >= n + (mode == "circular")):
        raise ValueError(f"F.pad mode={mode!r}: padding ({pl}, {pr}) too large for the sharded dim of length {n}")
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
    needs = tuple(
        tuple(_source_row(g - pl, n, mode) for g in range(o, o + s)) for o, s in zip(offsets_of(new_sizes), new_sizes)
    )
    ext = gather_window(input, needs, fill=0.0 if value is None else float(value))
    pad[2 * pos] = pad[2 * pos + 1] = 0
    ext = pad_local(ext, pad, mode, value)
    return adopt(ext, input.spec.with_sizes(tuple(new_sizes)))
