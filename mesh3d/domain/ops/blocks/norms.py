"""Norms on block-sharded tensors: GroupNorm, BatchNorm, InstanceNorm (statistics over the whole domain) and LayerNorm
(over the block dims it normalizes: the whole domain, or one grid line).

Usage: automatic; ``nn.GroupNorm(4, 16)(xs)`` on a tensor from ``domain.shard(x, dims=(2, 3))``. Each rule returns a
step whose compute normalizes the local block; the executor combines the statistics (``step.Combining``), as on slabs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.registry import BLOCK_RULES
from mesh3d.domain.dispatch.step import Combining, Step, whole_operands
from mesh3d.domain.ops.norm import normalize, rounded_like

__all__ = ["CHANNEL_NORMS"]


def _spec_of(x: DomainTensor) -> BlockSpec:
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    return spec


def _affine(y: torch.Tensor, weight, bias) -> torch.Tensor:
    shape = (1, -1, *([1] * (y.ndim - 2)))
    y = y * weight.view(shape) if weight is not None else y
    return y + bias.view(shape) if bias is not None else y


def _spatial(x: DomainTensor, op: str) -> Any:
    """Blocks, or a token grid ``(N, C, tokens)`` (the norms are the same: statistics over the whole domain)."""
    spec = x._spec
    if min(spec.dims) < 2 or getattr(spec, "keys", None) is not None:  # type: ignore[attr-defined]
        raise NotImplementedError(f"{op}: on blocks or token grids, shard spatial dims (>= 2) of the (N, C, ...) input")
    return spec


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    spec = _spatial(input, "F.group_norm")
    count = (input.shape[1] // num_groups) * math.prod(input.global_shape[2:])

    def norm(local: torch.Tensor, weight: Any, bias: Any, combine: Callable) -> torch.Tensor:
        n, c = local.shape[:2]
        grouped = local.reshape(n, num_groups, c // num_groups, math.prod(local.shape[2:]))
        y, _, _ = normalize(grouped, [2, 3], count, eps, combine, affine=(weight, bias))
        return rounded_like(_affine(y.reshape(local.shape), weight, bias), local)
    # NOTE: the statistics combine in compute, as on slabs
    return Step(norm, (input, *whole_operands("F.group_norm", weight, bias), Combining(spec.comm)), out=spec)


def _update_running(running, value, momentum) -> None:
    if running is not None:
        with torch.no_grad():
            running.mul_(1 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    spec = _spatial(input, "F.batch_norm")
    params = whole_operands("F.batch_norm", running_mean, running_var, weight, bias)
    if not training:
        return Step(lambda local, rm, rv, w, b: F.batch_norm(local, rm, rv, w, b, False, momentum, eps),
                    (input, *params), out=spec)
    count = input.global_shape[0] * math.prod(input.global_shape[2:])

    def norm(local: torch.Tensor, running_mean: Any, running_var: Any, weight: Any, bias: Any,
             combine: Callable) -> torch.Tensor:
        y, mean, var = normalize(local, [0, *range(2, local.ndim)], count, eps, combine, affine=(weight, bias))
        _update_running(running_mean, mean.flatten(), momentum)
        _update_running(running_var, var.flatten() * count / max(count - 1, 1), momentum)
        return rounded_like(_affine(y, weight, bias), local)
    return Step(norm, (input, *params, Combining(spec.comm)), out=spec)


def _instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                   momentum=0.1, eps=1e-5):
    spec = _spatial(input, "F.instance_norm")
    if not use_input_stats:
        return Step(lambda local, rm, rv, w, b: F.instance_norm(local, rm, rv, w, b, False, momentum, eps),
                    (input, *whole_operands("F.instance_norm", running_mean, running_var, weight, bias)), out=spec)
    if running_mean is not None or running_var is not None:
        raise NotImplementedError("F.instance_norm with track_running_stats on blocks: use slabs, or "
                                  "track_running_stats=False")
    count = math.prod(input.global_shape[2:])

    def norm(local: torch.Tensor, weight: Any, bias: Any, combine: Callable) -> torch.Tensor:
        y, _, _ = normalize(local, list(range(2, local.ndim)), count, eps, combine, affine=(weight, bias))
        return rounded_like(_affine(y, weight, bias), local)
    return Step(norm, (input, *whole_operands("F.instance_norm", weight, bias), Combining(spec.comm)), out=spec)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    spec = _spec_of(input)
    first = input.ndim - len(normalized_shape)
    axes = [axis for axis, d in enumerate(spec.dims) if d >= first]
    params = whole_operands("F.layer_norm", weight, bias)
    if not axes:  # the normalized dims are whole here (channels-last tokens): torch's kernel
        return Step(lambda local, w, b: F.layer_norm(local, normalized_shape, w, b, eps), (input, *params), out=spec)
    if len(axes) == len(spec.dims):
        comm = spec.comm
    elif len(axes) == 1:
        comm = spec.lines[axes[0]]  # statistics over one block dim: its grid line holds them
    else:
        raise NotImplementedError(f"F.layer_norm over {len(axes)} of the {len(spec.dims)} block dims: normalize over "
                                  "one block dim or all of them")
    count = math.prod(input.global_shape[first:])

    def norm(local: torch.Tensor, weight: Any, bias: Any, combine: Callable) -> torch.Tensor:
        y, _, _ = normalize(local, list(range(first, local.ndim)), count, eps, combine, affine=(weight, bias))
        w, b = weight, bias  # the affine parameters vary along the block dims: this rank's block of them
        for d, start, rows in zip(spec.dims, spec.offsets, spec.local_sizes):
            if d >= first:
                w = w.narrow(d - first, start, rows) if w is not None else None
                b = b.narrow(d - first, start, rows) if b is not None else None
        y = y * w if w is not None else y
        return rounded_like(y + b if b is not None else y, local)
    return Step(norm, (input, *params, Combining(comm)), out=spec)


for _func, _rule in ((F.group_norm, _group_norm), (F.batch_norm, _batch_norm), (F.instance_norm, _instance_norm),
                     (F.layer_norm, _layer_norm)):
    BLOCK_RULES.register(_func, _rule)
#: The channel norms, shared with token grids ``(N, C, tokens)`` (diffusers' attention blocks group-normalize them).
CHANNEL_NORMS = {F.group_norm: _group_norm, F.batch_norm: _batch_norm, F.instance_norm: _instance_norm}
