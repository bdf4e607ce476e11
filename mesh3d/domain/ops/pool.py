"""Max/avg pooling (1/2/3-D, any kernel/stride/dilation/padding) and adaptive pooling to a global size.

Usage: automatic for ``nn.MaxPool2d(2)(xs)``, ``F.avg_pool2d``, ``nn.AdaptiveAvgPool2d((4, 4))``.

Fixed windows use the conv halo planner (padding rows are -inf for max, 0 for avg, matching
``count_include_pad=True``). Adaptive pooling computes each owned output row from its global window
[floor(i*N/M), ceil((i+1)*N/M)) gathered from whichever ranks hold it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mesh3d.domain.halo.windows import WindowProbe, plan_window, sizes_by_first_index
from mesh3d.domain.ops.conv import as_tuple, spatial_axis
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.halo.windows import Extended, Window
from mesh3d.domain.dispatch.step import Rows, Step


def _out_len(n, k, s, p, d, ceil_mode):
    span = n + 2 * p - d * (k - 1) - 1
    m = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (m - 1) * s >= n + p:
        m -= 1
    return m


def _pool(input, kind: str, nd: int, func, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad,
          divisor_override, return_indices) -> Step:
    name = f"torch.nn.functional.{kind}_pool{nd}d"
    if return_indices:
        raise NotImplementedError(f"{name}(return_indices=True) is not supported on a domain tensor")
    if kind == "max":
        def call(t, ks, st, pd, ceil):
            return func(t, ks, st, pd, dilation, ceil)
    else:
        def call(t, ks, st, pd, ceil):
            if nd == 1:  # F.avg_pool1d has no divisor_override
                return func(t, ks, st, pd, ceil, count_include_pad)
            return func(t, ks, st, pd, ceil, count_include_pad, divisor_override)
    sp = spatial_axis(name, input, nd)
    if sp >= 0 and kind == "avg" and ((as_tuple(padding, nd)[sp] and not count_include_pad) or ceil_mode):
        # NOTE: refused at every domain size, one rank included, so a model checked on one rank
        # does not fail only when it is scaled out.
        raise NotImplementedError(
            f"{name}: count_include_pad=False with padding, or ceil_mode=True, along the sharded dim is not "
            "supported (the divisor would depend on the global edge); use count_include_pad=True, ceil_mode=False"
        )
    if sp < 0 or input.spec.comm.size == 1:
        out_sizes = input.spec.sizes
        if sp >= 0:  # one rank: torch's kernel on the whole dim, unchanged
            n = input.spec.sizes[0]
            k, s = as_tuple(kernel_size, nd)[sp], as_tuple(stride if stride not in (None, []) else kernel_size, nd)[sp]
            out_sizes = (_out_len(n, k, s, as_tuple(padding, nd)[sp], as_tuple(dilation, nd)[sp], ceil_mode),)
            if WindowProbe.active:
                WindowProbe.note(n, out_sizes[0])
        return Step(lambda t: call(t, kernel_size, stride if stride not in (None, []) else kernel_size, padding,
                                   ceil_mode), (input,), out=input.spec.with_sizes(out_sizes))
    ks = as_tuple(kernel_size, nd)
    st = as_tuple(stride if stride not in (None, []) else kernel_size, nd)
    pd, dl = as_tuple(padding, nd), as_tuple(dilation, nd)
    k, s, p, d = ks[sp], st[sp], pd[sp], dl[sp]
    n = sum(input.spec.sizes)
    plan = plan_window(input.spec.sizes, k, s, d, p, p, _out_len(n, k, s, p, d, ceil_mode))
    mine = plan.out_sizes[input.spec.comm.index]

    def compute(ext: Extended):
        if mine == 0:
            # This rank owns no output: its (empty) shard's shape by torch's formula, without running a kernel.
            shape = [*ext.tensor.shape[:2]] + [
                0 if i == sp else _out_len(ext.tensor.shape[2 + i], ks[i], st[i], pd[i], dl[i], ceil_mode)
                for i in range(nd)
            ]
            return connected_zeros(ext.tensor, shape, ext.tensor)
        local_pad = tuple(ext.pad if i == sp else pd[i] for i in range(nd))
        # The rows are exactly the windows this rank owns, so ceil_mode only matters on the other dims.
        return call(ext.tensor, ks, st, local_pad, ceil_mode)

    fill = -math.inf if kind == "max" else 0.0
    return Step(compute, (Window(input, plan, fill),), out=input.spec.with_sizes(plan.out_sizes))


def _max_rule(func, nd: int):
    def rule(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False) -> Step:
        return _pool(input, "max", nd, func, kernel_size, stride, padding, dilation, ceil_mode, True, None,
                     return_indices)

    return rule


def _avg_rule(func, nd: int):
    def rule(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None) -> Step:
        return _pool(input, "avg", nd, func, kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                     divisor_override, False)

    return rule


def _adaptive_rule(func, nd: int):
    def rule(input, output_size, return_indices=False) -> Step:
        if return_indices:
            raise NotImplementedError("adaptive max pooling with return_indices=True is not supported")
        sp = spatial_axis(func.__name__, input, nd)
        if sp < 0:
            return Step(lambda t: func(t, output_size), (input,), out=input.spec)
        sizes, n = input.spec.sizes, sum(input.spec.sizes)
        out = [o if o is None else int(o) for o in as_tuple(output_size, nd)]  # t.shape sizes: global
        m = out[sp] if out[sp] is not None else n
        if input.spec.comm.size == 1:
            return Step(lambda t: func(t, output_size), (input,), out=input.spec.with_sizes((m,)))
        # Output i pools rows [floor(i*n/m), ceil((i+1)*n/m)); its owner holds the first of them.
        out_sizes = sizes_by_first_index(sizes, m, lambda row: -(-(row * m) // n))
        me = input.spec.comm.index
        a, mine = offsets_of(out_sizes)[me], out_sizes[me]
        first = (a * n) // m
        needs = tuple((Span.rows((lo * n) // m, -(-((lo + cnt) * n) // m)),) if cnt else ()
                      for lo, cnt in zip(offsets_of(out_sizes), out_sizes))
        piece_size = [1 if i == sp else o for i, o in enumerate(out)]

        def compute(ext):
            if mine and n % m == 0:  # equal windows: one call pools this rank's run of them
                return func(ext, [mine if i == sp else o for i, o in enumerate(out)])
            pieces = [func(ext.narrow(2 + sp, (i * n) // m - first, -(-((i + 1) * n) // m) - (i * n) // m), piece_size)
                      for i in range(a, a + mine)]
            if pieces:
                return torch.cat(pieces, 2 + sp)
            shape = [*ext.shape[:2]] + [0 if i == sp else (o if o is not None else ext.shape[2 + i])
                                        for i, o in enumerate(out)]
            return connected_zeros(ext, shape, ext)

        return Step(compute, (Rows(input, needs),), out=input.spec.with_sizes(out_sizes))

    return rule


for _nd in (1, 2, 3):
    register(getattr(F, f"max_pool{_nd}d"))(_max_rule(getattr(F, f"max_pool{_nd}d"), _nd))
    register(getattr(F, f"avg_pool{_nd}d"))(_avg_rule(getattr(F, f"avg_pool{_nd}d"), _nd))
    register(getattr(F, f"adaptive_avg_pool{_nd}d"))(_adaptive_rule(getattr(F, f"adaptive_avg_pool{_nd}d"), _nd))
    register(getattr(F, f"adaptive_max_pool{_nd}d"))(_adaptive_rule(getattr(F, f"adaptive_max_pool{_nd}d"), _nd))
