"""Composite rules: ops written as other ruled ops, the same for slabs, blocks and token grids.

Usage: importing registers them; on a domain tensor ``torch.logsumexp(xs, dim=2)``, ``torch.var_mean(xs, (2, 3))``,
``F.smooth_l1_loss(ys, ts)`` or ``F.nll_loss(F.log_softmax(ys, 1), labels)`` give the one-process value.

Each rule is the op's formula as torch computes it (the same guards, clamps and reductions), every step sent back
through the dispatcher (``redispatch``): a composite is exact wherever its parts are (a reduction over a sharded dim
is one all-reduce, a mean divides by the global count), its gradient is the formula's own, it refuses by the name of
a part that a layout cannot run, and it stays traceable under ``torch.compile`` (no tensor is built from a shard).
NOTE: torch raises on some bad values inside its kernels (a probability outside [0, 1], a class index out of
range); the composites check the same, one reduction each, before computing, so every rank raises alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_compiling
import torch.nn.functional as F

from mesh3d.domain.core.tensor import DomainTensor, size_of
from mesh3d.domain.dispatch.dispatcher import redispatch
from mesh3d.domain.dispatch.registry import BLOCK_RULES, RULES, TOKEN_RULES

__all__ = ["call", "count_true", "loss_reduction", "register_composite"]

#: The layouts every composite serves (graphs have their own reductions over items, strided slabs their own views).
_TABLES = (RULES, BLOCK_RULES, TOKEN_RULES)


def _holds_domain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_domain(v) for v in value)
    return isinstance(value, DomainTensor)


def call(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``func`` through the dispatcher where a domain tensor takes part (lists of them too), plainly where none does
    (a weight's arithmetic).

    Usage: ``call(torch.sub, call(torch.Tensor.narrow, x, d, 1, n - 1), call(torch.Tensor.narrow, x, d, 0, n - 1))``
    """
    if _holds_domain(args) or _holds_domain(tuple(kwargs.values())):
        return redispatch(func, *args, **kwargs)
    return func(*args, **kwargs)


def register_composite(*funcs: Callable) -> Callable[[Callable], Callable]:
    """Register a composite rule for ``funcs`` on slabs, blocks and token grids.

    Usage: ``@register_composite(torch.logsumexp, torch.Tensor.logsumexp)`` above the rule, written with ``call``
    """
    def add(rule: Callable) -> Callable:
        for table in _TABLES:
            for func in funcs:
                table.register(func, rule)
        return rule

    return add


def _all_dims(x: torch.Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    return sorted(d % x.ndim for d in ([dim] if isinstance(dim, int) else dim))


def _no_out(out: Any, name: str) -> None:
    if out is not None:
        raise NotImplementedError(f"{name}(out=...) on a domain tensor: assign the result instead (y = {name}(...))")


def _checking() -> bool:
    """Value checks cost a reduction and a host read: eager only (a compiled graph has no host reads)."""
    return not is_compiling()


def count_true(mask: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """How many elements of a boolean tensor are set (along ``dim``, or in all): a sum, ruled on every layout.

    Usage: ``count_true(call(torch.isnan, xs), dim=2)``
    """
    ones = call(torch.Tensor.to, mask, torch.int64)
    return call(torch.sum, ones) if dim is None else call(torch.sum, ones, dim, keepdim=keepdim)


def _any(mask: Any) -> bool:
    """Whether any element of a boolean tensor is set, anywhere, as a Python bool on every rank."""
    count = count_true(mask)
    return int(count.to_local() if isinstance(count, DomainTensor) else count) > 0


# ---------------------------------------------------------------------------------------------- reductions
@register_composite(torch.logsumexp, torch.Tensor.logsumexp)
def _logsumexp(input, dim=None, keepdim=False, *, out=None):
    _no_out(out, "torch.logsumexp")
    dims = _all_dims(input, dim)
    top = call(torch.Tensor.detach, call(torch.amax, input, dims, True))
    top = call(torch.where, call(torch.isinf, top), 0.0, top)  # as torch: an all -inf (or +inf) slice gives -inf (inf)
    total = call(torch.sum, call(torch.exp, call(torch.sub, input, top)), dims, True)
    result = call(torch.add, call(torch.log, total), top)
    return result if keepdim else call(torch.Tensor.squeeze, result, tuple(dims))


@register_composite(torch.amin, torch.Tensor.amin)
def _amin(input, dim=(), keepdim=False, *, out=None):
    _no_out(out, "torch.amin")
    return call(torch.neg, call(torch.amax, call(torch.neg, input), _all_dims(input, dim), keepdim))


@register_composite(torch.aminmax, torch.Tensor.aminmax)
def _aminmax(input, *, dim=None, keepdim=False, out=None):
    _no_out(out, "torch.aminmax")
    dims = _all_dims(input, dim)
    return torch.return_types.aminmax((_amin(input, dims, keepdim), call(torch.amax, input, dims, keepdim)))


def _moments(spread: Callable, name: str) -> Callable:
    """``torch.var_mean`` / ``std_mean`` in each of torch's argument forms: the spread and the mean, each ruled."""
    def rule(input, *args, dim=None, unbiased=None, keepdim=False, correction=None, out=None):
        _no_out(out, name)
        if args and isinstance(args[0], bool):  # (x, unbiased)
            unbiased, args = args[0], args[1:]
        elif args:                              # (x, dim, unbiased, keepdim)
            dim, args = args[0], args[1:]
            if args:
                unbiased, args = args[0], args[1:]
            if args:
                keepdim, args = args[0], args[1:]
        if args:
            raise TypeError(f"{name}: too many positional arguments")
        if correction is not None and unbiased is not None:
            raise TypeError(f"{name}: give correction= or unbiased=, not both")
        corr = correction if correction is not None else (1 if unbiased is None else int(unbiased))
        dims = _all_dims(input, dim)
        return call(spread, input, dims, correction=corr, keepdim=keepdim), call(torch.mean, input, dims, keepdim=keepdim)

    return rule


register_composite(torch.var_mean)(_moments(torch.var, "torch.var_mean"))
register_composite(torch.std_mean)(_moments(torch.std, "torch.std_mean"))


@register_composite(torch.cosine_similarity)
def _cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """Each operand over its norm clamped to ``eps``, then their product summed along ``dim`` (torch's formula, after
    broadcasting the two as torch does)."""
    if size_of(x1) != size_of(x2):
        x1, x2 = _broadcast_tensors(x1, x2)
    unit1 = call(torch.div, x1, call(torch.clamp_min, call(torch.linalg.vector_norm, x1, 2, dim, True), eps))
    unit2 = call(torch.div, x2, call(torch.clamp_min, call(torch.linalg.vector_norm, x2, 2, dim, True), eps))
    return call(torch.sum, call(torch.mul, unit1, unit2), dim)


# ---------------------------------------------------------------------------------------------- losses
def loss_reduction(name: str, size_average: Any, reduce: Any, reduction: Any,
                   allowed: tuple[str, ...] = ("none", "mean", "sum")) -> str:
    """torch's legacy ``size_average``/``reduce`` read as torch reads them, then the reduction checked; ATen's integer
    reduction (0, 1, 2: an ``aten.*_loss`` operator called with a domain tensor) is the name it stands for.

    Usage: ``reduction = loss_reduction("F.mse_loss", size_average, reduce, reduction)`` first in a loss rule (a rule
    gets the legacy arguments as the user passed them: torch reads them after ``__torch_function__``)"""
    if isinstance(reduction, int) and not isinstance(reduction, bool):
        reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
    if size_average is not None or reduce is not None:
        keep = True if reduce is None else reduce
        reduction = "none" if not keep else ("mean" if (True if size_average is None else size_average) else "sum")
    if reduction not in allowed:
        raise ValueError(f"{name}: reduction={reduction!r} is not one of {', '.join(map(repr, allowed))}")
    return reduction


def _reduced(loss, reduction: str):
    if reduction == "none":
        return loss
    return call(torch.mean if reduction == "mean" else torch.sum, loss)


def _weighted(loss, weight):
    return loss if weight is None else call(torch.mul, loss, weight)


@register_composite(F.smooth_l1_loss)
def _smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    reduction = loss_reduction("F.smooth_l1_loss", size_average, reduce, reduction)
    if beta < 0:
        raise ValueError(f"F.smooth_l1_loss: beta={beta} must not be negative")
    distance = call(torch.abs, call(torch.sub, input, target))
    if beta == 0:
        return _reduced(distance, reduction)
    quadratic = call(torch.div, call(torch.mul, call(torch.square, distance), 0.5), beta)
    return _reduced(call(torch.where, call(torch.lt, distance, beta), quadratic, call(torch.sub, distance, 0.5 * beta)),
                    reduction)


@register_composite(F.huber_loss)
def _huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    reduction = loss_reduction("F.huber_loss", None, None, reduction)
    if delta <= 0:
        raise ValueError(f"F.huber_loss: delta={delta} must be positive")
    if weight is not None and size_of(weight) != size_of(input):
        raise ValueError(f"F.huber_loss: weight= of size {tuple(size_of(weight))} must have the input's size "
                         f"{tuple(size_of(input))}, as torch requires")
    distance = call(torch.abs, call(torch.sub, input, target))
    quadratic = call(torch.mul, call(torch.square, distance), 0.5)
    linear = call(torch.mul, call(torch.sub, distance, 0.5 * delta), delta)
    return _reduced(_weighted(call(torch.where, call(torch.lt, distance, delta), quadratic, linear), weight), reduction)


@register_composite(F.binary_cross_entropy_with_logits)
def _bce_with_logits(input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None):
    """``(1 - t) x + w_t (log1p(exp(-|x|)) + max(-x, 0))``, ``w_t = 1 + (pos_weight - 1) t``: torch's stable form."""
    reduction = loss_reduction("F.binary_cross_entropy_with_logits", size_average, reduce, reduction)
    softplus = call(torch.add, call(torch.log1p, call(torch.exp, call(torch.neg, call(torch.abs, input)))),
                  call(torch.clamp_min, call(torch.neg, input), 0))
    if pos_weight is not None:
        softplus = call(torch.mul, softplus, call(torch.add, call(torch.mul, call(torch.sub, pos_weight, 1), target), 1))
    loss = call(torch.add, call(torch.mul, call(torch.rsub, target, 1), input), softplus)
    return _reduced(_weighted(loss, weight), reduction)


@register_composite(F.binary_cross_entropy)
def _binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """``-(t log x + (1 - t) log(1 - x))`` with each log clamped at -100, as torch's kernel."""
    reduction = loss_reduction("F.binary_cross_entropy", size_average, reduce, reduction)
    if _checking() and _any(call(torch.logical_or, call(torch.lt, input, 0), call(torch.gt, input, 1))):
        raise ValueError("F.binary_cross_entropy: every input must lie in [0, 1] (probabilities); for logits use "
                         "F.binary_cross_entropy_with_logits")
    log_x = call(torch.clamp_min, call(torch.log, input), -100)
    log_rest = call(torch.clamp_min, call(torch.log, call(torch.rsub, input, 1)), -100)
    loss = call(torch.neg, call(torch.add, call(torch.mul, target, log_x), call(torch.mul, call(torch.rsub, target, 1), log_rest)))
    return _reduced(_weighted(loss, weight), reduction)


@register_composite(F.kl_div)
def _kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    reduction = loss_reduction("F.kl_div", size_average, reduce, reduction, ("none", "mean", "sum", "batchmean"))
    if log_target:
        loss = call(torch.mul, call(torch.exp, target), call(torch.sub, target, input))
    else:
        loss = call(torch.sub, call(torch.xlogy, target, target), call(torch.mul, target, input))
    if reduction == "batchmean":
        total = call(torch.sum, loss)
        return total if input.ndim == 0 else call(torch.div, total, size_of(input)[0])
    return _reduced(loss, reduction)


@register_composite(F.gaussian_nll_loss)
def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """``0.5 (log v + (x - t)^2 / v)``, ``v`` clamped to ``eps`` without changing its gradient (torch's no_grad
    clamp), its shape read as torch reads it (the input's, or one dim fewer, or a trailing 1)."""
    reduction = loss_reduction("F.gaussian_nll_loss", None, None, reduction)
    if isinstance(var, (int, float)):
        if var < 0:
            raise ValueError("F.gaussian_nll_loss: var has negative entry/entries")
        var = max(float(var), eps)
    else:
        shape, vshape = size_of(input), size_of(var)
        if vshape != shape:
            if shape[:-1] == vshape:
                var = call(torch.Tensor.unsqueeze, var, -1)
            elif not (shape[:-1] == vshape[:-1] and vshape[-1] == 1):
                raise ValueError(f"F.gaussian_nll_loss: var of size {tuple(vshape)} fits neither the input's "
                                 f"{tuple(shape)} nor it without its last dim (or with a last dim of 1)")
        if _checking() and _any(call(torch.lt, var, 0)):
            raise ValueError("F.gaussian_nll_loss: var has negative entry/entries")
        clamped = call(torch.clamp_min, var, eps)
        var = call(torch.add, var, call(torch.Tensor.detach, call(torch.sub, clamped, var)))
    loss = call(torch.mul, call(torch.add, call(torch.log, var) if not isinstance(var, float) else math.log(var),
                            call(torch.div, call(torch.square, call(torch.sub, input, target)), var)), 0.5)
    if full:
        loss = call(torch.add, loss, 0.5 * math.log(2 * math.pi))
    return _reduced(loss, reduction)


@register_composite(F.nll_loss)
def _nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    """``-w[t] x[n, t]`` picked by comparing the target with the class ids (the class dim, 1, is never split); a mean
    divides by the summed weights of the targets not ignored, as torch."""
    reduction = loss_reduction("F.nll_loss", size_average, reduce, reduction)
    if input.ndim < 2:
        raise NotImplementedError("F.nll_loss of a 1-d input on a domain tensor: give (N, C, ...) scores")
    classes = size_of(input)[1]
    ids = torch.arange(classes, device=input.device).view(1, classes, *[1] * (input.ndim - 2))
    if _checking():
        wrong = call(torch.logical_and, call(torch.ne, target, ignore_index),
                   call(torch.logical_or, call(torch.lt, target, 0), call(torch.ge, target, classes)))
        if _any(wrong):
            raise ValueError(f"F.nll_loss: a target is out of bounds: class ids are 0..{classes - 1} (or "
                             f"ignore_index={ignore_index})")
    hit = call(torch.eq, call(torch.Tensor.unsqueeze, target, 1), ids)
    picked = call(torch.sum, call(torch.where, hit, input, 0.0), 1)
    kept = call(torch.Tensor.to, call(torch.ne, target, ignore_index), input.dtype)
    if weight is not None:
        kept = call(torch.mul, kept, call(torch.sum, call(torch.where, hit, weight.view(ids.shape).to(input.dtype), 0.0), 1))
    loss = call(torch.neg, call(torch.mul, picked, kept))
    if reduction != "mean":
        return _reduced(loss, reduction)
    return call(torch.div, call(torch.sum, loss), call(torch.Tensor.detach, call(torch.sum, kept)))


# ---------------------------------------------------------------------------------------------- rearrangements
@register_composite(torch.rot90, torch.Tensor.rot90)
def _rot90(input, k=1, dims=(0, 1)):
    """torch's own steps: a flip, then a transpose, by ``k`` mod 4."""
    if len(dims) != 2:
        raise ValueError(f"torch.rot90: dims={tuple(dims)} must name two dims")
    d0, d1 = (d % input.ndim for d in dims)
    if d0 == d1:
        raise ValueError(f"torch.rot90: dims={tuple(dims)} must name two different dims")
    k %= 4
    if k == 1:
        return call(torch.transpose, call(torch.flip, input, [d1]), d0, d1)
    if k == 2:
        return call(torch.flip, input, [d0, d1])
    if k == 3:
        return call(torch.transpose, call(torch.flip, input, [d0]), d0, d1)
    return call(torch.clone, input)


@register_composite(torch.pixel_shuffle, F.pixel_shuffle)
def _pixel_shuffle(input, upscale_factor):
    """``(*, C r^2, H, W) -> (*, C, H r, W r)`` as torch's own view, permute and reshape."""
    r, shape = upscale_factor, size_of(input)
    if input.ndim < 3 or shape[-3] % (r * r):
        raise ValueError(f"F.pixel_shuffle: the channels ({shape[-3] if input.ndim >= 3 else '-'}) of a (*, C, H, W) "
                         f"input must divide by upscale_factor^2 = {r * r}")
    *lead, c, h, w = shape
    split = call(torch.Tensor.reshape, input, (*lead, c // (r * r), r, r, h, w))
    n = len(lead)
    moved = call(torch.Tensor.permute, split, (*range(n), n, n + 3, n + 1, n + 4, n + 2))
    return call(torch.Tensor.reshape, moved, (*lead, c // (r * r), h * r, w * r))


@register_composite(torch.pixel_unshuffle, F.pixel_unshuffle)
def _pixel_unshuffle(input, downscale_factor):
    """``(*, C, H r, W r) -> (*, C r^2, H, W)`` as torch's own view, permute and reshape."""
    r, shape = downscale_factor, size_of(input)
    if input.ndim < 3 or shape[-2] % r or shape[-1] % r:
        raise ValueError(f"F.pixel_unshuffle: the height and width of a (*, C, H, W) input ({tuple(shape[-2:])}) "
                         f"must divide by downscale_factor = {r}")
    *lead, c, h, w = shape
    split = call(torch.Tensor.reshape, input, (*lead, c, h // r, r, w // r, r))
    n = len(lead)
    moved = call(torch.Tensor.permute, split, (*range(n), n, n + 2, n + 4, n + 1, n + 3))
    return call(torch.Tensor.reshape, moved, (*lead, c * r * r, h // r, w // r))


# ---------------------------------------------------------------------------------------------- encodings and shapes
@register_composite(F.one_hot)
def _one_hot(tensor, num_classes=-1):
    """``t[..., None] == arange(C)`` as int64; ``num_classes=-1`` reads the global maximum, as torch."""
    if tensor.dtype != torch.int64:
        raise ValueError(f"F.one_hot: the indices must be int64 (torch.long), not {tensor.dtype}")
    if num_classes < 0:
        num_classes = int(call(torch.amax, tensor).to_local()) + 1
    if _checking() and _any(call(torch.logical_or, call(torch.lt, tensor, 0), call(torch.ge, tensor, num_classes))):
        raise ValueError(f"F.one_hot: a class index lies outside 0..{num_classes - 1}")
    classes = torch.arange(num_classes, device=tensor.device)
    return call(torch.Tensor.to, call(torch.eq, call(torch.Tensor.unsqueeze, tensor, -1), classes), torch.int64)


@register_composite(torch.broadcast_tensors)
def _broadcast_tensors(*tensors):
    """Each operand expanded to the operands' broadcast shape (global sizes)."""
    shape = torch.broadcast_shapes(*(size_of(t) for t in tensors))
    return tuple(call(torch.Tensor.expand, t, shape) for t in tensors)


@register_composite(getattr(torch.Tensor, "mT").__get__)
def _matrix_transpose(input, owner=None):
    return call(torch.transpose, input, -2, -1)


@register_composite(getattr(torch.Tensor, "mH").__get__)
def _matrix_adjoint(input, owner=None):
    swapped = call(torch.transpose, input, -2, -1)
    return call(torch.conj, swapped) if input.is_complex() else swapped
