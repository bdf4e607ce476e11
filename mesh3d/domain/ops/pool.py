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

from mesh3d.domain.halo import owners_by_position, plan_window, sizes_from_owners
from mesh3d.domain.ops.conv import _tuple, _weight_connected_zeros, gather_window, spatial_axis
from mesh3d.domain.registry import register
from mesh3d.domain.split import offsets_of
from mesh3d.domain.tensor import adopt, unwrap


def _out_len(n, k, s, p, d, ceil_mode):
    span = n + 2 * p - d * (k - 1) - 1
    m = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (m - 1) * s >= n + p:
        m -= 1
    return m


def _pool_rule(func, nd: int, kind: str):
    name = f"torch.nn.functional.{kind}_pool{nd}d"

    def rule(input, kernel_size, stride=None, padding=0, *args, **kwargs):
        if kind == "max":
            dilation, ceil_mode, return_indices = (list(args) + [1, False, False][len(args):])[:3]
            dilation = kwargs.get("dilation", dilation)
            ceil_mode = kwargs.get("ceil_mode", ceil_mode)
            if kwargs.get("return_indices", return_indices):
                raise NotImplementedError(f"{name}(return_indices=True) is not supported on a domain tensor")
        else:
            ceil_mode, count_include_pad, divisor = (list(args) + [False, True, None][len(args):])[:3]
            ceil_mode = kwargs.get("ceil_mode", ceil_mode)
            count_include_pad = kwargs.get("count_include_pad", count_include_pad)
            divisor = kwargs.get("divisor_override", divisor)
            dilation = 1
        sp = spatial_axis(name, input, nd)
        if sp < 0:
            return adopt(func(unwrap(input), kernel_size, stride, padding, *args, **kwargs), input.spec)
        ks = _tuple(kernel_size, nd)
        st = _tuple(stride if stride not in (None, []) else kernel_size, nd)
        pd, dl = _tuple(padding, nd), _tuple(dilation, nd)
        k, s, p, d = ks[sp], st[sp], pd[sp], dl[sp]
        if kind == "avg" and ((p and not count_include_pad) or ceil_mode):
            raise NotImplementedError(
                f"{name}: count_include_pad=False with padding, or ceil_mode=True, along the sharded dim is not "
                "supported (the divisor would depend on the global edge); use count_include_pad=True, ceil_mode=False"
            )
        n = sum(input.spec.sizes)
        plan = plan_window(input.spec.sizes, k, s, d, p, p, _out_len(n, k, s, p, d, ceil_mode))
        ext = gather_window(input, plan.needs, fill=-math.inf if kind == "max" else 0.0)
        local_pad = tuple(0 if i == sp else pd[i] for i in range(nd))
        if plan.out_sizes[input.spec.comm.index] == 0:
            # This rank owns no output: its (empty) shard's shape by torch's formula, without running a kernel.
            shape = [*ext.shape[:2]] + [
                0 if i == sp else _out_len(ext.shape[2 + i], ks[i], st[i], pd[i], dl[i], ceil_mode) for i in range(nd)
            ]
            y = _weight_connected_zeros(ext, shape, ext)
        elif kind == "max":
            y = func(ext, ks, st, local_pad, dl, ceil_mode)
        else:
            y = func(ext, ks, st, local_pad, ceil_mode, count_include_pad, divisor)
        return adopt(y, input.spec.with_sizes(plan.out_sizes))

    return rule


def _adaptive_rule(func, nd: int):
    def rule(input, output_size, *args, return_indices=False):
        if (args and args[0]) or return_indices:
            raise NotImplementedError("adaptive max pooling with return_indices=True is not supported")
        sp = spatial_axis(func.__name__, input, nd)
        local = unwrap(input)
        if sp < 0:
            return adopt(func(local, output_size), input.spec)
        sizes, n = input.spec.sizes, sum(input.spec.sizes)
        out = list(_tuple(output_size, nd))
        m = out[sp] if out[sp] is not None else n
        starts = [(i * n) // m for i in range(m)]
        ends = [-(-((i + 1) * n) // m) for i in range(m)]
        out_sizes = sizes_from_owners(owners_by_position(sizes, starts), len(sizes))
        a = offsets_of(out_sizes)[input.spec.comm.index]
        bounds = [(a_r, a_r + size) for a_r, size in zip(offsets_of(out_sizes), out_sizes)]
        needs = tuple(tuple(range(starts[lo], ends[hi - 1])) if hi > lo else () for lo, hi in bounds)
        ext = gather_window(input, needs)
        mine = out_sizes[input.spec.comm.index]
        piece_size = [1 if i == sp else o for i, o in enumerate(out)]
        pieces = [func(ext.narrow(2 + sp, starts[i] - starts[a], ends[i] - starts[i]), piece_size)
                  for i in range(a, a + mine)]
        if pieces:
            y = torch.cat(pieces, 2 + sp)
        else:
            shape = [*local.shape[:2]] + [0 if i == sp else (o if o is not None else local.shape[2 + i])
                                          for i, o in enumerate(out)]
            y = _weight_connected_zeros(ext, shape, ext)
        return adopt(y, input.spec.with_sizes(out_sizes))

    return rule


for _nd in (1, 2, 3):
    register(getattr(F, f"max_pool{_nd}d"))(_pool_rule(getattr(F, f"max_pool{_nd}d"), _nd, "max"))
    register(getattr(F, f"avg_pool{_nd}d"))(_pool_rule(getattr(F, f"avg_pool{_nd}d"), _nd, "avg"))
    register(getattr(F, f"adaptive_avg_pool{_nd}d"))(_adaptive_rule(getattr(F, f"adaptive_avg_pool{_nd}d"), _nd))
    register(getattr(F, f"adaptive_max_pool{_nd}d"))(_adaptive_rule(getattr(F, f"adaptive_max_pool{_nd}d"), _nd))
