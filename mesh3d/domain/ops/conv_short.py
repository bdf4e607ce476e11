"""Convolutions whose rows need no exchange go straight to torch's kernel (``dispatch.short_path``).

A convolution along a sharded slab needs the halo rows its rule plans (``ops.conv``). Where this rank's plan moves
nothing and copies nothing (a one-rank domain, a 1x1 kernel at stride 1, any window whose rows are all this rank's
own) and the padding left to the kernel is symmetric, the rule's step is torch's convolution on the shard with that
padding: the short path calls it directly, from a plan kept per signature (spec, input dims, kernel, stride, padding,
dilation), with the current weight and bias, journaled on a multi-rank domain as the rule's window is. Everything
else (halos to fetch, an empty output shard, asymmetric padding, the batch or a channel dim sharded, weights that
are domain tensors or DTensors) takes the rule. Wrapper tensors take it too (on their shard's differentiable alias, the
result behind one edge, ``core.wrapped.fresh_wrapper``), except while AOTAutograd traces them.

Usage: importing registers it for ``F.conv1d``, ``F.conv2d`` and ``F.conv3d``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d._torch_private import disable_torch_function_subclass
from mesh3d.domain.core.plan_cache import plan_cache
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.wrapped import WrappedDomainTensor, fresh_wrapper
from mesh3d.domain.dispatch.short_path import (
    SHORT, WRAPPED_SHORT, journal_layout_change, reclassed, rule_unchanged, take_short_path)
from mesh3d.domain.dispatch.writes import fresh_layout
from mesh3d.domain.halo.windows import Extended, plan_window, window_exchange
from mesh3d.domain.ops.conv import as_tuple, kernel_padding, pad_pairs

__all__ = ["local_conv_plan"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@plan_cache(maxsize=4096)
def local_conv_plan(spec: DomainSpec, ndim: int, nd: int, ks: tuple[int, ...], stride: Any, padding: Any,
                    dilation: Any) -> tuple[tuple[int, ...], DomainSpec] | None:
    """(the kernel's padding, the result's spec) when this rank's convolution is torch's on its shard as is, else None.

    Usage: ``local_conv_plan(xs.spec, 4, 2, (3, 3), 1, 1, 1)  # ((1, 1), spec) on a one-rank domain``
    """
    sp = spec.dim - (ndim - nd)
    if spec.dim == 0 or sp < 0:
        return None
    stride, dilation = as_tuple(stride, nd), as_tuple(dilation, nd)
    pads = pad_pairs(padding, ks, dilation, nd)
    plan = plan_window(spec.sizes, ks[sp], stride[sp], dilation[sp], *pads[sp])
    me = spec.comm.index
    xplan, pad = window_exchange(spec.sizes, plan, me, True)
    if not (xplan.moves_nothing and xplan.is_local_view) or plan.out_sizes[me] == 0 or sum(plan.out_sizes) == 1:
        return None
    local = kernel_padding(pads, sp, Extended(torch.empty(0), pad))
    return None if local is None else (local, spec.with_sizes(plan.out_sizes))


def _arguments(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return input, weight, bias, stride, padding, dilation, groups


def _short_conv(nd: int) -> Callable[[Callable, tuple, dict | None], Any]:
    def short(func: Callable, args: tuple, kwargs: dict | None) -> Any:
        if not rule_unchanged(func):
            return NotImplemented
        try:
            x, weight, bias, stride, padding, dilation, groups = _arguments(*args, **(kwargs or {}))
        except TypeError:  # not F.conv's signature: the rule raises what torch would
            return NotImplemented
        kind = type(x)
        if kind is not DomainTensor and (kind is not WrappedDomainTensor or torch.compiler.is_compiling()):
            return NotImplemented  # NOTE: AOTAutograd's trace of wrapper tensors runs the rules on fake shards
        if type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
            return NotImplemented
        spec = x._spec
        if type(spec) is not DomainSpec or spec.dim is None or spec.outer != 1:
            return NotImplemented
        with disable_torch_function_subclass():
            try:
                plan = local_conv_plan(spec, x.ndim, nd, tuple(weight.shape[2:]), stride, padding, dilation)
            except TypeError:  # an argument that does not hash (a list)
                return NotImplemented
            if plan is None:
                return NotImplemented
            # NOTE: the shard's alias, as ``unwrap`` (a wrapper's: the one its rules read, ``_differentiable_local``)
            local = x.as_subclass(torch.Tensor) if kind is DomainTensor else x._differentiable_local()
            try:
                out = func(local, weight, bias, stride, plan[0], dilation, groups)
            except Exception:  # noqa: BLE001 - the rule runs it again and tells the peers (a multi-rank domain)
                return NotImplemented
        if spec.comm.size > 1:  # NOTE: the rule's step declares a window: the dispatcher journals it on every rank
            journal_layout_change(func, plan[1])
        if kind is DomainTensor:
            return reclassed(out, plan[1])
        return fresh_layout(fresh_wrapper(out, plan[1]), func, args, kwargs)  # NOTE: a channels-last input's layout

    return short


for _nd, _f in ((1, F.conv1d), (2, F.conv2d), (3, F.conv3d)):
    take_short_path(_f, _short_conv(_nd))
    WRAPPED_SHORT[_f] = SHORT[_f]
