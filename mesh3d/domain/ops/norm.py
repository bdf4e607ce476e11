"""BatchNorm, GroupNorm, InstanceNorm and LayerNorm with statistics over the whole domain.

Usage: automatic for ``nn.GroupNorm(...)(xs)`` etc. Statistics are over global counts (right for uneven and empty
shards): each shard's count, mean and squared deviations, merged in one combine as Chan et al.'s parallel variance
does: as stable as one process's two passes. Running statistics of
BatchNorm/InstanceNorm are updated with the global (unbiased) variance, identically on every rank.
bf16/fp16 inputs are normalized in float32, the affine included, and rounded once, as torch's fused kernels do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mesh3d.domain.comm.collectives import sum_dtype
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.step import Combining, Step, whole_operands
from mesh3d.domain.core.linear import recordable
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.ops.moments import merged_moments

__all__ = ["normalize", "rounded_like"]


class _Normalize(torch.autograd.Function):
    """(x - mean) * rstd over ``dims`` of the whole domain, saving one full-size tensor for backward, as torch's fused
    norms do: its output when an affine follows (the affine's multiply saves that output anyway), else its input.

    NOTE: written out as ``x - mean``, ``centred * rstd`` in autograd, the normalization saved two full-size tensors
    (``centred`` and the normalized output, which the affine's multiply saves again). Saving one is what brings a
    conv/GroupNorm step at D=2 to half of one process's peak memory. Without an affine the output is the user's
    tensor, which an in-place op may change (MONAI's InstanceNorm then ``LeakyReLU(inplace=True)``): the input is
    saved then, and the output recomputed in backward. Backward: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
    both means over the whole domain (one all-reduce). ``combine``: a ``step.Combining``'s (the executor's).
    """

    @staticmethod
    def forward(local, dims, count, eps, combine, save_output):
        mean, spread = merged_moments(local, dims, combine)
        mean, var = mean.to(local.dtype), (spread / count).to(local.dtype)
        centred = local - mean
        rstd = torch.rsqrt(var + eps)
        normalized = centred.mul_(rstd)
        return normalized, mean, var, rstd

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # NOTE: the form torch.func's transforms run
        local, ctx.dims, ctx.count, _, ctx.combine, ctx.save_output = inputs
        normalized, mean, var, rstd = output
        ctx.save_for_backward(normalized if ctx.save_output else local, mean, rstd)
        ctx.mark_non_differentiable(var)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad, grad_mean, _grad_var, grad_rstd):
        saved, mean, rstd = ctx.saved_tensors
        normalized = saved if ctx.save_output else (saved - mean) * rstd
        dims, count, combine = ctx.dims, ctx.count, ctx.combine
        if torch.is_grad_enabled():
            # NOTE: create_graph=True (second derivatives): the same formula in recorded ops on this node's own outputs
            # (normalized, mean, rstd), with all-reduces whose backward sums, so its gradient comes back through here.
            return _recorded_backward(grad, grad_mean, grad_rstd, normalized, rstd, dims, count, combine), *(None,) * 5
        out = None
        if grad is not None:
            sums = torch.stack([grad.sum(dims, keepdim=True), (grad * normalized).sum(dims, keepdim=True)])
            means = combine(sums, grad=False) / count
            out = rstd * (grad - means[0] - normalized * means[1])
        for g, term in ((grad_mean, 1.0), (grad_rstd, -rstd * rstd * normalized)):  # used directly: rarely
            if g is not None:
                part = combine(g, grad=False) / count * term
                out = part.expand(normalized.shape) if out is None else out + part
        return out, None, None, None, None, None


def _recorded_backward(grad, grad_mean, grad_rstd, normalized, rstd, dims, count, combine):
    """``_Normalize.backward`` in differentiable ops: dx = rstd (g - M(g) - xhat M(g xhat)) + S(g_mean) / n
    - S(g_rstd) rstd^2 xhat / n, with M a mean and S a sum over the whole domain."""
    grad, grad_mean, grad_rstd = (None if g is None else recordable(g) for g in (grad, grad_mean, grad_rstd))
    out = torch.zeros_like(normalized)
    if grad is not None:
        means = combine(torch.stack([grad.sum(dims, keepdim=True), (grad * normalized).sum(dims, keepdim=True)]),
                        for_shards=True) / count
        out = rstd * (grad - means[0] - normalized * means[1])
    if grad_mean is not None:
        out = out + combine(grad_mean, for_shards=True) / count
    if grad_rstd is not None:
        out = out - combine(grad_rstd, for_shards=True) / count * rstd * rstd * normalized
    return out


def normalize(local: torch.Tensor, dims: list[int], count: int, eps: float, combine, affine: tuple = ()):
    """(x - mean) / sqrt(var + eps) with mean/var over ``dims`` of the whole domain (their parts combined by
    ``combine``, a ``step.Combining``'s); also returns both (no gradient).

    ``affine``: the (weight, bias) the caller applies to the result; with either, the result is not user code's tensor.
    A bf16/fp16 ``local`` is normalized in float32 (the result too): the caller applies the affine, then ``_rounded``.
    """
    acc = sum_dtype(local.dtype)
    return _Normalize.apply(local if acc is None else local.to(acc), dims, count, eps, combine,
                            any(p is not None for p in affine))[:3]


def rounded_like(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The float32 result of a half-precision input's normalization (affine applied), rounded once to its dtype.

    Usage: ``return rounded_like(_affine(y, weight, bias), local)`` after ``y, _, _ = normalize(local, ...)``
    """
    return y if y.dtype == like.dtype else y.to(like.dtype)


def _affine(y: torch.Tensor, weight, bias, ndim: int) -> torch.Tensor:
    shape = (1, -1, *([1] * (ndim - 2)))
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


def _check(op: str, x: DomainTensor) -> None:
    if x.spec.dim is None or x.spec.dim < 2:
        raise NotImplementedError(f"{op}: shard a spatial dim (>= 2) of the (N, C, ...) input, not N or C")


def _whole(x: DomainTensor, func, *args) -> Step | None:
    """One domain rank holds the whole dim: torch's fused kernel is the one-process op."""
    if x.spec.comm.size == 1:
        return Step(func, (x, *args), out=x.spec)
    return None


@register(F.group_norm)
def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5) -> Step:
    _check("F.group_norm", input)
    whole = _whole(input, F.group_norm, num_groups, weight, bias, eps)
    if whole:
        return whole
    count_rest = math.prod(input.global_shape[2:])
    comm = input.spec.comm

    # NOTE: the weight and bias are the step's arguments, never values its function closes over (nor the input): the
    # step holds the call's tensors only where they were passed, so a later call binds its own (``dispatch.kept``)
    def compute(local, weight, bias, combine):
        n, c = local.shape[:2]
        grouped = local.reshape(n, num_groups, c // num_groups, math.prod(local.shape[2:]))
        y, _, _ = normalize(grouped, [2, 3], (c // num_groups) * count_rest, eps, combine, affine=(weight, bias))
        return rounded_like(_affine(y.reshape(local.shape), weight, bias, local.ndim), local)

    return Step(compute, (input, *whole_operands("F.group_norm", weight, bias), Combining(comm)), out=input.spec)


def _update_running(running, value, momentum) -> None:
    if running is not None:
        with torch.no_grad():
            running.mul_(1 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


@register(F.batch_norm)
def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                eps=1e-5) -> Step:
    _check("F.batch_norm", input)
    if not training or input.spec.comm.size == 1:
        return Step(F.batch_norm, (input, running_mean, running_var, weight, bias, training, momentum, eps),
                    out=input.spec)
    count = input.global_shape[0] * math.prod(input.global_shape[2:])
    comm = input.spec.comm

    def compute(local, running_mean, running_var, weight, bias, combine):  # NOTE: as group_norm's
        y, mean, var = normalize(local, [0, *range(2, local.ndim)], count, eps, combine, affine=(weight, bias))
        _update_running(running_mean, mean.flatten(), momentum)
        _update_running(running_var, var.flatten() * count / max(count - 1, 1), momentum)
        return rounded_like(_affine(y, weight, bias, local.ndim), local)

    return Step(compute, (input, *whole_operands("F.batch_norm", running_mean, running_var, weight, bias),
                          Combining(comm)), out=input.spec)


@register(F.instance_norm)
def _instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                   momentum=0.1, eps=1e-5) -> Step:
    _check("F.instance_norm", input)
    if not use_input_stats or input.spec.comm.size == 1:
        return Step(F.instance_norm, (input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps),
                    out=input.spec)
    count = math.prod(input.global_shape[2:])
    comm = input.spec.comm

    def compute(local, running_mean, running_var, weight, bias, combine):  # NOTE: as group_norm's
        y, mean, var = normalize(local, list(range(2, local.ndim)), count, eps, combine, affine=(weight, bias))
        _update_running(running_mean, mean.flatten(2).mean(0).flatten(), momentum)
        _update_running(running_var, (var * count / max(count - 1, 1)).flatten(2).mean(0).flatten(), momentum)
        return rounded_like(_affine(y, weight, bias, local.ndim), local)

    return Step(compute, (input, *whole_operands("F.instance_norm", running_mean, running_var, weight, bias),
                          Combining(comm)), out=input.spec)


@register(F.layer_norm)
def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5) -> Step:
    first = input.ndim - len(normalized_shape)
    if input.spec.dim < first or input.spec.comm.size == 1:
        return Step(F.layer_norm, (input, normalized_shape, *whole_operands("F.layer_norm", weight, bias), eps),
                    out=input.spec)
    count = math.prod(input.global_shape[first:])
    at = input.spec.dim - first
    offset, rows = input.offset, input.spec.sizes[input.spec.comm.index]
    comm = input.spec.comm

    def compute(local, weight, bias, combine):  # NOTE: as group_norm's
        y, _, _ = normalize(local, list(range(first, local.ndim)), count, eps, combine, affine=(weight, bias))
        # The affine parameters vary along the sharded dim: use this rank's slice of them.
        if weight is not None:
            y = y * weight.narrow(at, offset, rows)
        if bias is not None:
            y = y + bias.narrow(at, offset, rows)
        return rounded_like(y, local)

    return Step(compute, (input, *whole_operands("F.layer_norm", weight, bias), Combining(comm)), out=input.spec)
