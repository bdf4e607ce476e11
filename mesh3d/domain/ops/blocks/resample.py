"""Block rules for pooling, transposed convolution, interpolation, ``F.pad`` and ``torch.cat``.

Usage: automatic for ``nn.MaxPool2d(2)(xs)``, ``nn.ConvTranspose2d(8, 8, 2, stride=2)(xs)``,
``nn.Upsample(scale_factor=2, mode="bilinear")(xs)``, ``F.pad(xs, (1, 1, 1, 1), mode="circular")`` and
``torch.cat([xs, ys], dim=1)`` on block-sharded tensors (``domain.shard(x, dims=(2, 3))``).

Each op does per block dim what its slab rule does along the one sharded dim, and declares the rows it reads
(``Boxes``, resolved by the executor). Pooling reads its windows (``blocks.window_plans``); transposed convolution
and padding modes read the source rows their outputs read by the slab rules' row formulas, every neighbour's box
(corners included) in one round (``blocks.box_plans``), as does upsampling interpolation. Downsampling interpolation
and adaptive pooling go one grid dim after the other (a step per dim, resampling between them: the second moves rows
already shrunk along the first dim, and the corners arrive with them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh3d._torch_private import PAD_BUILTIN
from mesh3d.domain.core.specs import BlockSpec, Layout
from mesh3d.domain.layouts.blocks import box_plans, window_plans
from mesh3d.domain.core.settings import SETTINGS
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.step import Boxes, LineRows, Narrowed, Relaid, Step, Whole
from mesh3d.domain.comm.collectives import sum_dtype
from mesh3d.domain.halo.windows import sizes_by_first_index
from mesh3d.domain.ops.conv import padded_rows, as_tuple, bias_rows, pad_local, transpose_plan
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.ops.interpolate import row_plan, lerp_rows
from mesh3d.domain.ops.weighted_resample import blocks_weighted_interpolate
from mesh3d.domain.dispatch.registry import BLOCK_RULES, op_name
from mesh3d.domain.ops.blocks.rules import in_block_layout
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import DomainTensor, size_of
from mesh3d.domain.core.specs import sharded_dims

__all__: list[str] = []


def _blocks_of(x: DomainTensor, op: str, nd: int) -> BlockSpec:
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    if min(spec.dims) < x.ndim - nd:
        raise NotImplementedError(f"{op}: on blocks, shard spatial dims (>= {x.ndim - nd}) only, got {spec.dims}")
    return spec


def _zeros_like_out(ext: torch.Tensor, shape: list[int], spec: BlockSpec, *params) -> torch.Tensor:
    for d, count in zip(spec.dims, spec.local_sizes):
        shape[d] = count
    return connected_zeros(ext, [max(v, 0) for v in shape], ext, *params)


# ----------------------------------------------------------------------------- pooling
def _pool(kind: str, nd: int, func: Callable) -> Callable:
    name = f"torch.nn.functional.{kind}_pool{nd}d"

    def run(input, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override, extra):
        spec = _blocks_of(input, name, nd)
        if ceil_mode or extra:
            raise NotImplementedError(f"{name}: ceil_mode=True or return_indices=True on blocks; use the defaults")
        first = input.ndim - nd
        ks, pd, dl = as_tuple(kernel_size, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
        st = as_tuple(stride if stride not in (None, []) else kernel_size, nd)
        if kind == "avg" and not count_include_pad and any(pd[d - first] for d in spec.dims):
            raise NotImplementedError(f"{name}: count_include_pad=False with padding along a block dim (the divisor "
                                      "would depend on the global edge); use count_include_pad=True")
        pads = [(p, p) for p in pd]
        plans, out_spec = window_plans(spec, first, ks, st, dl, pads)

        def pool(ext: torch.Tensor) -> torch.Tensor:
            if 0 in out_spec.local_sizes:
                shape = [*ext.shape[:first]] + [(ext.shape[first + i] + sum(pads[i]) - dl[i] * (ks[i] - 1) - 1)
                                                // st[i] + 1 for i in range(nd)]
                return _zeros_like_out(ext, shape, out_spec)
            symmetric = all(lo == hi and lo <= ks[i] // 2 for i, (lo, hi) in enumerate(pads))
            local_pad = tuple(lo for lo, _ in pads) if symmetric else 0
            if not symmetric:  # edge blocks: the padding their kernel would add, added here (-inf for max)
                flat = [v for i in reversed(range(nd)) for v in pads[i]]
                ext = F.pad(ext, flat, value=-math.inf if kind == "max" else 0.0)
            if kind == "max":
                return func(ext, ks, st, local_pad, dl, False)
            if nd == 1:  # F.avg_pool1d has no divisor_override
                return func(ext, ks, st, local_pad, False, True)
            return func(ext, ks, st, local_pad, False, True, divisor_override)

        return Step(pool, (Boxes(input, plans, 0.0, SETTINGS.value.overlap.blocks),), out=out_spec)

    if kind == "max":
        def rule(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
            return run(input, kernel_size, stride, padding, dilation, ceil_mode, True, None, return_indices)
    else:
        def rule(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
            return run(input, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, divisor_override, False)
    return rule


# ----------------------------------------------------------------------------- transposed convolution
def _conv_transpose(func: Callable, nd: int) -> Callable:
    name = f"torch.nn.functional.conv_transpose{nd}d"

    def rule(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        spec = _blocks_of(input, name, nd)
        first = input.ndim - nd
        stride, padding, dilation = as_tuple(stride, nd), as_tuple(padding, nd), as_tuple(dilation, nd)
        output_padding = as_tuple(output_padding, nd)
        out_sizes, crops, all_needs = [], [], []
        for d, sizes, line in zip(spec.dims, spec.sizes, spec.lines):
            i = d - first
            s, p, dl, k = stride[i], padding[i], dilation[i], weight.shape[2 + i]
            m = (sum(sizes) - 1) * s - 2 * p + dl * (k - 1) + output_padding[i] + 1
            outs, needs, starts = transpose_plan(sizes, m, s, p, dl, k)
            all_needs.append(needs)
            me = line.index
            crops.append((d, starts[me] * s - p - offsets_of(outs)[me], outs[me], bool(needs[me])))
            out_sizes.append(outs)
        out_spec = spec.with_sizes(tuple(out_sizes))
        local_pad = tuple(0 if first + i in spec.dims else padding[i] for i in range(nd))
        local_op = tuple(0 if first + i in spec.dims else output_padding[i] for i in range(nd))

        def transposed(local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if not all(has for *_, has in crops):  # no contributing input rows: only the bias (or an empty block)
                ref = func(local.new_zeros([*local.shape[:first], *[1] * nd]), weight, None, stride, 0, 0, groups,
                           dilation)
                shape = list(ref.shape)
                for i in range(nd):
                    if first + i not in spec.dims:
                        shape[first + i] = (local.shape[first + i] - 1) * stride[i] - 2 * padding[i] + \
                            dilation[i] * (weight.shape[2 + i] - 1) + output_padding[i] + 1
                y = _zeros_like_out(local, shape, out_spec, weight)
                return y + bias.view(1, -1, *([1] * nd)) if bias is not None else y
            # NOTE: the bias inside torch's kernel, as one process adds it: one rounding in bf16/fp16, not two.
            y = func(local, weight, bias, stride, local_pad, local_op, groups, dilation)
            for d, start, size, _ in crops:  # where this rank's first output sits in y's rows, per block dim
                y = y.narrow(d, -start, min(size, y.shape[d] + start)) if start <= 0 else y
                short = size - y.shape[d] - max(start, 0)
                if start > 0 or short > 0:  # rows no input reaches: the bias alone
                    y = bias_rows(y, d, max(start, 0), short, bias)
            return y

        # every source row, all block dims in one round
        return Step(transposed, (Boxes(input, box_plans(spec, all_needs)), weight, bias), out=out_spec)

    return rule


# ----------------------------------------------------------------------------- interpolation
def _interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None,
                 antialias=False):
    nd = input.ndim - 2
    spec = _blocks_of(input, "F.interpolate", nd)
    if mode in ("bicubic", "area") or antialias:  # wider windows: torch's own weights (ops/weighted_resample.py)
        return blocks_weighted_interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor,
                                           antialias)
    if mode not in ("nearest", "linear", "bilinear", "trilinear"):
        raise NotImplementedError(f"F.interpolate(mode={mode!r}) on blocks; use nearest, linear, bilinear, "
                                  "trilinear, bicubic or area")
    shape = list(input.global_shape[2:])
    sfs = None if scale_factor is None else list(as_tuple(scale_factor, nd))
    if recompute_scale_factor and sfs is not None:
        size, sfs = [math.floor(g * f) for g, f in zip(shape, sfs)], None
    outs = [int(n) for n in as_tuple(size, nd)] if size is not None else \
        [math.floor(n * f) for n, f in zip(shape, sfs)]
    per_dim, out_sizes = [], []
    # NOTE: bf16/fp16 interpolated in float32 and rounded once, as torch's kernels do (see ops/interpolate.py).
    acc = None if mode == "nearest" else sum_dtype(input.dtype)
    for d, sizes, line in zip(spec.dims, spec.sizes, spec.lines):
        m = outs[d - 2]
        mine, needs, i0, i1, lam = row_plan(sizes, m, sfs[d - 2] if sfs else None, mode, align_corners,
                                             acc or input.dtype, line.index)
        per_dim.append((d, needs, i0, i1, lam))
        out_sizes.append(mine)
    # NOTE: upsampling, the source rows are fewer than the resampled ones: fetch them all in one round. Downsampling,
    # one grid dim after the other sends rows already shrunk along the earlier dims.
    upsampling = all(outs[d - 2] >= sum(sizes) for d, sizes in zip(spec.dims, spec.sizes))

    def along(local: torch.Tensor, d: int, i0, i1, lam) -> torch.Tensor:
        if not i0:
            shape_now = list(local.shape)
            shape_now[d] = 0
            return connected_zeros(local, shape_now, local)
        return lerp_rows(local, d, i0, i1, lam, mode)

    def rest(local: torch.Tensor) -> torch.Tensor:
        sizes = [local.shape[2 + i] if 2 + i in spec.dims else outs[i] for i in range(nd)]
        if sizes == list(local.shape[2:]):
            return local if acc is None else local.to(input.dtype)
        if local.numel():
            local = F.interpolate(local, size=sizes, mode=mode, align_corners=align_corners)
        else:
            local = connected_zeros(local, [*local.shape[:2], *sizes], local)
        return local if acc is None else local.to(input.dtype)

    out_spec = spec.with_sizes(tuple(out_sizes))
    if upsampling:
        def resampled(local: torch.Tensor) -> torch.Tensor:
            local = local if acc is None else local.to(acc)
            for d, _, i0, i1, lam in per_dim:
                local = along(local, d, i0, i1, lam)
            return rest(local)
        return Step(resampled, (Boxes(input, box_plans(spec, [p[1] for p in per_dim])),), out=out_spec)
    x, sizes_now = input, list(spec.sizes)
    for axis, (d, needs, i0, i1, lam) in enumerate(per_dim):
        sizes_now[axis] = out_sizes[axis]

        def one_dim(local: torch.Tensor, axis=axis, d=d, i0=i0, i1=i1, lam=lam) -> torch.Tensor:
            local = local.to(acc) if axis == 0 and acc is not None else local
            local = along(local, d, i0, i1, lam)
            return rest(local) if axis == len(per_dim) - 1 else local
        step = Step(one_dim, (LineRows(x, ((axis, needs),)),), out=spec.with_sizes(tuple(sizes_now)))
        if axis == len(per_dim) - 1:
            return step
        x = run_step(step)  # NOTE: the next grid dim sends rows already shrunk along this one
    raise AssertionError("blocks have at least one grid dim")


# ----------------------------------------------------------------------------- padding and cat
def _pad(input, pad, mode="constant", value=None):
    spec = input._spec
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise ValueError(f"F.pad mode={mode!r} is not supported on blocks")
    pad, new_sizes, all_needs = list(pad), [], []
    for d, sizes in zip(spec.dims, spec.sizes):
        pos = input.ndim - 1 - d
        pl, pr = (pad[2 * pos], pad[2 * pos + 1]) if 2 * pos + 1 < len(pad) else (0, 0)
        n = sum(sizes)
        if pl < 0 or pr < 0 or (mode in ("reflect", "circular") and max(pl, pr) >= n + (mode == "circular")):
            raise ValueError(f"F.pad on blocks: padding ({pl}, {pr}) along dim {d} (global length {n}) is negative "
                             "or too large for the mode")
        new = list(sizes)
        nonempty = [r for r, s in enumerate(sizes) if s > 0]
        new[nonempty[0]] += pl
        new[nonempty[-1]] += pr
        all_needs.append(tuple(padded_rows(o, o + s, n, pl, mode) for o, s in zip(offsets_of(new), new)))
        new_sizes.append(tuple(new))
        if 2 * pos + 1 < len(pad):
            pad[2 * pos] = pad[2 * pos + 1] = 0
    # every padded block dim in one round; the fill value fills constant padding's rows (and their corners)
    return Step(lambda local: pad_local(local, pad, mode, value),
                (Boxes(input, box_plans(spec, all_needs), 0.0 if value is None else float(value)),),
                out=spec.with_sizes(tuple(new_sizes)))


def _cat(tensors, dim=0):
    blocks = [t for t in tensors if isinstance(t, DomainTensor) and isinstance(t._spec, BlockSpec)]
    spec = blocks[0]._spec
    assert isinstance(spec, BlockSpec)
    dim = dim % blocks[0].ndim
    if dim in spec.dims:
        raise NotImplementedError(f"{op_name(torch.cat)} on blocks: join along another dim than the block dims "
                                  f"{spec.dims}")
    whole = size_of(blocks[0])

    def local(t):
        if isinstance(t, DomainTensor) and isinstance(t._spec, BlockSpec):
            return in_block_layout(t, spec)  # a face turned by rot90 too: its grid axes on other dims
        if isinstance(t, DomainTensor) and t.ndim == len(whole) and t._spec.layout is Layout.SLAB \
                and t._spec.dim in spec.dims and t._spec.comm == spec.comm:
            return Relaid(t, None, spec.dims, spec.sizes)  # a window attention's output (its windows ran on slabs)
        if isinstance(t, DomainTensor) and sharded_dims(t._spec) or t.ndim != len(whole):
            raise NotImplementedError(f"{op_name(torch.cat)} on blocks: every input must be a block tensor laid out "
                                      f"alike, or a plain one of the global shape (dims {spec.dims})")
        for d in spec.dims:  # a plain tensor of the global lengths (coordinates, Fourier features)
            if size_of(t)[d] != whole[d]:
                raise NotImplementedError(f"{op_name(torch.cat)} on blocks: a tensor of shape {tuple(t.shape)} next to "
                                          f"blocks of global shape {tuple(whole)}; give it the global lengths")
        return Narrowed(t, tuple((d, spec.offsets[k], spec.local_sizes[k]) for k, d in enumerate(spec.dims)))

    return Step(lambda *ts: torch.cat(ts, dim), tuple(local(t) for t in tensors), out=spec,
                keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))


# ----------------------------------------------------------------------------- adaptive pooling
def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _adaptive_along(local: torch.Tensor, d: int, first: int, count: int, n: int, m: int, kind: str) -> torch.Tensor:
    """Adaptive pooling along dim ``d`` only (avg and max are separable over rectangular windows): this rank's
    outputs ``first .. first + count``, windows [floor(i*n/m), ceil((i+1)*n/m)), from the gathered rows (the
    first of which is row floor(first*n/m))."""
    reduce = torch.amax if kind == "max" else torch.mean
    start = (first * n) // m
    pieces = [reduce(local.narrow(d, (i * n) // m - start, -(-((i + 1) * n) // m) - (i * n) // m), d, keepdim=True)
              for i in range(first, first + count)]
    if pieces:
        return torch.cat(pieces, d) if len(pieces) > 1 else pieces[0]
    shape = list(local.shape)
    shape[d] = 0
    return connected_zeros(local, shape, local)


def _adaptive(kind: str, nd: int) -> Callable:
    name = f"torch.nn.functional.adaptive_{kind}_pool{nd}d"

    def rule(input, output_size, return_indices=False):
        spec = _blocks_of(input, name, nd)
        if return_indices:
            raise NotImplementedError(f"{name}(return_indices=True) on blocks")
        first_dim = input.ndim - nd
        outs = [o if o is None else int(o) for o in as_tuple(output_size, nd)]
        x, sizes_now = input, list(spec.sizes)
        for axis, (d, sizes, line) in enumerate(zip(spec.dims, spec.sizes, spec.lines)):
            n = sum(sizes)
            m = outs[d - first_dim] if outs[d - first_dim] is not None else n
            # Output i pools rows [floor(i*n/m), ceil((i+1)*n/m)); its owner holds the first of them (the slab rule).
            mine = sizes_by_first_index(sizes, m, lambda row, n=n, m=m: -(-(row * m) // n))
            needs = tuple((Span.rows((lo * n) // m, -(-((lo + c) * n) // m)),) if c else ()
                          for lo, c in zip(offsets_of(mine), mine))
            sizes_now[axis] = mine
            start, count = offsets_of(mine)[line.index], mine[line.index]
            # NOTE: one grid dim after the other, each pass sending rows already pooled along the earlier dims
            x = run_step(Step(lambda t, d=d, start=start, count=count, n=n, m=m: _adaptive_along(t, d, start, count, n,
                                                                                                   m, kind),
                              (LineRows(x, ((axis, needs),)),), out=spec.with_sizes(tuple(sizes_now))))

        def rest_pool(local: torch.Tensor) -> torch.Tensor:  # the dims that are whole here: torch's kernel (separable)
            rest = [local.shape[first_dim + i] if first_dim + i in spec.dims or outs[i] is None else outs[i]
                    for i in range(nd)]
            if rest == list(local.shape[first_dim:]):
                return local.view_as(local)
            if local.numel():
                return getattr(F, f"adaptive_{kind}_pool{nd}d")(local, rest)
            return connected_zeros(local, [*local.shape[:first_dim], *rest], local)

        pooled = Step(rest_pool, (x,), out=x._spec)
        if not all(sum(s) == 1 for s in sizes_now):
            return pooled
        return Step(_itself, (Whole(run_step(pooled)),), out=DomainSpec.replicated(spec.comm))  # global pooling

    return rule


for _nd in (1, 2, 3):
    BLOCK_RULES.register(getattr(F, f"max_pool{_nd}d"), _pool("max", _nd, getattr(F, f"max_pool{_nd}d")))
    BLOCK_RULES.register(getattr(F, f"avg_pool{_nd}d"), _pool("avg", _nd, getattr(F, f"avg_pool{_nd}d")))
    BLOCK_RULES.register(getattr(F, f"conv_transpose{_nd}d"),
                         _conv_transpose(getattr(F, f"conv_transpose{_nd}d"), _nd))
BLOCK_RULES.register(F.interpolate, _interpolate)
for _nd in (1, 2, 3):
    for _kind in ("avg", "max"):
        BLOCK_RULES.register(getattr(F, f"adaptive_{_kind}_pool{_nd}d"), _adaptive(_kind, _nd))
BLOCK_RULES.register(F.pad, _pad)
BLOCK_RULES.register(PAD_BUILTIN, _pad)  # NOTE: what a compiled graph of wrapper tensors records for F.pad
for _f in (torch.cat, torch.concat):
    BLOCK_RULES.register(_f, _cat)
