"""Reductions (sum, mean, amax/max, var, std, prod) and losses (mse, l1, cross-entropy) over sharded dims.

Usage: ``(ys * ys).mean()``, ``ys.sum(dim=(2, 3))``, ``F.mse_loss(ys, ts)`` give the one-process value
on every domain rank, as a replicated domain tensor (``sharded_dim is None``).

No tensor is gathered: each rank reduces its shard and one all-reduce of the partial results
combines them; means divide by the *global* count, so uneven shards weigh correctly. Variance merges each
rank's count, mean and squared deviations in one exchange (``moments.variance``), not E[x²]-E[x]².
Gradients follow ``collectives``: the result's gradient goes to each shard unchanged, so a rank's
backward yields exactly its shard's share (no factor of the domain size). Partial sums of bf16/fp16
shards are float32 until the result is rounded, once (``collectives.sum_dtype``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d._torch_private import argument_torch_dropped
from mesh3d.domain.comm.collectives import sum_dtype
from mesh3d.domain.ops.composite import call, loss_reduction
from mesh3d.domain.ops.moments import variance
from mesh3d.domain.ops.pointwise import elementwise
from mesh3d.domain.dispatch.registry import op_name, register
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.step import Combining, Entering, Partial, Step
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap

__all__ = ["amax_over_ranks", "domain_reduce", "global_softmax", "prod_step", "reduction_rule",
           "reduction_step", "total_step"]


def _dims(x: DomainTensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(d % x.ndim for d in dims)


def amax_over_ranks(local: torch.Tensor, dims: list[int], combine: Callable) -> torch.Tensor:
    """The one-process ``torch.amax(x, dims, keepdim=True)`` where ``dims`` hold every sharded dim, replicated: each
    rank's maxima (an empty part's are the lowest value), combined (``combine``: a ``step.Combining``'s) as a max; the
    value is exactly the max, the gradient shared among ties on every rank holding one, as torch.amax shares it.

    Usage: ``Step(lambda t, combine: amax_over_ranks(t, [2, 3], combine), (xs, Combining(spec.comm)), out=...)``"""
    shape = [1 if d in dims else s for d, s in enumerate(local.shape)]
    floating = local.is_floating_point()
    lowest = -math.inf if floating else False if local.dtype == torch.bool else torch.iinfo(local.dtype).min
    part = local.amax(dims, keepdim=True) if local.numel() else local.new_full(shape, lowest)  # an empty shard's
    top = combine(part, "max")
    if not floating:  # no gradient to share among ties, and the dtype stays
        return top
    hit = local == top
    ties = combine(hit.to(local.dtype).sum(dims, keepdim=True)).detach()
    # NOTE: where, not local * mask: a -inf beside the maximum (a masked score) times 0 is nan
    picked = combine(torch.where(hit, local, 0).sum(dims, keepdim=True)) / ties
    # Value exactly the max; gradient shared among ties as torch.amax does.
    return top + (picked - picked.detach())


def total_step(x: DomainTensor, kind: str, dim, dims: list[int], keepdim: bool, comm, full_kernel: bool) -> Step:
    """The step of ``sum`` / ``mean`` / ``prod`` / ``amax`` over ``dims`` holding every sharded dim of ``x`` (any layout:
    blocks, token grids, graphs; ``dim``: as the caller was given it, prod takes one or none): the one-process value,
    replicated. Sums, means and products declare their parts partial (``step.Partial``: a product's in its slot of a
    (D, ...) stack, multiplied in rank order); the maximum combines its own (``amax_over_ranks``: its ties' gradient).
    ``full_kernel``: a sum over every dim uses torch's full reduction (``t.sum()``), as the layout's rule always did.

    Usage: ``return total_step(xs, "mean", None, [0, 1, 2, 3], False, spec.comm, True)``"""
    out, dtype = DomainSpec.replicated(comm), unwrap(x).dtype
    if kind == "amax":
        return Step(lambda t, combine: amax_over_ranks(t, dims, combine) if keepdim else
                    amax_over_ranks(t, dims, combine).squeeze(dims), (x, Combining(comm)), out=out)
    if kind == "prod":
        one, index, size = None if dim is None else dims[0], comm.index, comm.size

        def slot(t: torch.Tensor) -> torch.Tensor:
            part = torch.prod(t) if one is None else torch.prod(t, one, keepdim=True)
            return torch.stack([part if q == index else torch.zeros_like(part) for q in range(size)])

        def product(stack: torch.Tensor) -> torch.Tensor:
            whole = stack.prod(0)
            return whole if one is None or keepdim else whole.squeeze(one)

        return Step(slot, (x,), out=out, partial=Partial("sum", product))
    count = math.prod([size_of(x)[d] for d in dims])
    acc = sum_dtype(dtype)  # float32 partial sums of half shards, rounded once
    everything = full_kernel and len(dims) == x.ndim and not keepdim

    def part(t: torch.Tensor) -> torch.Tensor:
        return t.sum(dtype=acc) if everything else t.sum(dims, keepdim=keepdim, dtype=acc)

    def finish(r: torch.Tensor) -> torch.Tensor:
        r = r / count if kind == "mean" else r
        return r if acc is None else r.to(dtype)

    return Step(part, (x,), out=out, partial=Partial("sum", finish))


def reduction_step(x: DomainTensor, kind: str, dim=None, keepdim: bool = False, correction: float = 1.0) -> Step:
    """The step reducing ``x`` over ``dim`` (all dims when None) to its one-process value, with no gather: local where
    the sharded dim survives; else a sum, mean or maximum is ``total_step``'s (a sum's parts declared partial), and
    variance merges each rank's moments in one exchange (``moments.variance``).
    The step holds ``x`` and plain data only, so it is kept per call signature (``dispatch.kept_steps``).

    Usage: ``run_step(reduction_step(xs, "mean", (2, 3)))``"""
    dims, spec = _dims(x, dim), x.spec
    if spec.dim not in dims:  # the sharded dim survives: a purely local reduction
        reduce = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax}.get(kind)

        def local(t: torch.Tensor) -> torch.Tensor:
            if reduce is not None:
                return reduce(t, dims, keepdim=keepdim)
            r = torch.var(t, dims, correction=correction, keepdim=keepdim)
            return r.sqrt() if kind == "std" else r

        new_dim = spec.dim if keepdim else spec.dim - sum(d < spec.dim for d in dims)
        return Step(local, (x,), out=spec.with_sizes(spec.sizes, dim=new_dim))
    comm = spec.comm
    if kind in ("sum", "mean", "amax"):  # NOTE: the layouts' own step: a sum's parts partial, the maximum's ties its own
        return total_step(x, kind, dim, dims, keepdim, comm, full_kernel=True)
    if kind in ("var", "std"):
        count = math.prod([x.global_shape[d] for d in dims])
        dtype = unwrap(x).dtype
        acc = sum_dtype(dtype)

        def spread(t: torch.Tensor, combine: Callable) -> torch.Tensor:
            r = variance(t if acc is None else t.to(acc), dims, count, correction, combine)
            r = r.sqrt() if kind == "std" else r
            r = r.squeeze(dims) if not keepdim else r
            return r if acc is None else r.to(dtype)
        return Step(spread, (x, Combining(comm)), out=DomainSpec.replicated(comm))
    raise ValueError(f"reduction_step: kind={kind!r} is one of sum, mean, amax, var, std")


def domain_reduce(x: DomainTensor, kind: str, dim=None, keepdim: bool = False, correction: float = 1.0) -> torch.Tensor:
    """Reduce ``x`` over ``dim`` (all dims when None): one-process value, no gather (``reduction_step``, run)."""
    return run_step(reduction_step(x, kind, dim, keepdim, correction))


def reduction_rule(kind: str, reducer=None):
    """The rule of ``torch.<kind>`` / ``Tensor.<kind>``: torch's argument forms parsed, then
    ``reducer(input, kind, dim, keepdim, correction)`` (``reduction_step`` unless given: blocks and token grids pass
    their own).

    Usage: ``TOKEN_RULES.register(torch.var, reduction_rule("var", grid_reduce))``
    """
    def rule(input, dim=None, *args, keepdim=False, dtype=None, correction=None, unbiased=None, out=None):
        if isinstance(dim, bool):  # var(x, unbiased)
            unbiased, dim = dim, None
        if args:  # positional keepdim / unbiased (var(x, dim, unbiased, keepdim))
            if kind in ("var", "std") and len(args) == 2:
                unbiased, keepdim = args
            elif kind in ("var", "std") and isinstance(args[0], bool) and len(args) == 1 and kind != "sum":
                unbiased = args[0]
            else:
                keepdim = args[0]
        if out is not None:
            raise NotImplementedError(f"torch.{kind}(out=...) is not supported on a domain tensor")
        if dtype is not None:
            input = elementwise(torch.Tensor.to, input, dtype)
        corr = 1.0 if correction is None and unbiased is None else (correction if correction is not None else float(unbiased))
        return (reducer or reduction_step)(input, kind, dim, keepdim, corr)

    return rule


for _kind, _funcs in {
    "sum": (torch.sum, torch.Tensor.sum),
    "mean": (torch.mean, torch.Tensor.mean),
    "amax": (torch.amax, torch.Tensor.amax),
    "var": (torch.var, torch.Tensor.var),
    "std": (torch.std, torch.Tensor.std),
}.items():
    register(*_funcs)(reduction_rule(_kind))


def _extreme_rule(sign: int):
    def rule(input, *args, **kwargs):
        if args or kwargs:
            raise NotImplementedError(
                "torch.max/min with dim= or a second tensor on a domain tensor: use torch.amax(x, dim) or "
                "torch.maximum(a, b); arg-indices over a sharded dim are not supported"
            )
        if sign > 0:
            return reduction_step(input, "amax")
        return -domain_reduce(elementwise(torch.neg, input), "amax")

    return rule


register(torch.max, torch.Tensor.max)(_extreme_rule(1))
register(torch.min, torch.Tensor.min)(_extreme_rule(-1))


def prod_step(x: DomainTensor, dim: int | None = None, keepdim: bool = False) -> Step:
    """The step of ``torch.prod(x)`` or ``torch.prod(x, dim, keepdim)``: the one-process product, exact forward and
    backward.

    Along another dim it is local. Along the sharded dim (or over everything) each rank multiplies its own rows into its
    slot of a (D, ...) stack, zeros in the others': the stacks' sum over the ranks (``step.Partial``) holds every rank's
    product, multiplied in rank order (``total_step``). Backward is torch's own, exact with zeros.

    Usage: ``run_step(prod_step(xs, 2))``
    """
    spec = x.spec
    if dim is not None:
        if not -x.ndim <= dim < x.ndim:
            raise IndexError(f"torch.prod: dim={dim} is out of range for a {x.ndim}-D tensor")
        dim %= x.ndim
        if dim != spec.dim:
            new_dim = spec.dim if keepdim or dim > spec.dim else spec.dim - 1
            return Step(lambda t: torch.prod(t, dim, keepdim=keepdim), (x,), out=spec.with_sizes(spec.sizes, dim=new_dim))
    return total_step(x, "prod", dim, [] if dim is None else [dim], keepdim, spec.comm, False)


@register(torch.prod, torch.Tensor.prod)
def _prod(input, dim=None, keepdim=False, *, dtype=None, out=None):
    if out is not None:
        raise NotImplementedError("torch.prod(out=...) is not supported on a domain tensor; use the result")
    if not (dim is None or isinstance(dim, int)):
        raise TypeError(f"torch.prod: dim must be one int (torch takes one), got {dim!r}")
    if dtype is not None:
        input = elementwise(torch.Tensor.to, input, dtype)
    return prod_step(input, dim, keepdim)


class _KnownTotal(torch.autograd.Function):
    """A total over the domain whose value is known (merged from the ranks' parts), recorded as the sum of each rank's
    ``term``: its gradient reaches every rank's term summed over the domain, to any order (that sum is its own
    adjoint)."""

    @staticmethod
    def forward(term, total, combine):
        return total.clone()

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:  # NOTE: the form torch.func's transforms run
        ctx.combine = inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return ctx.combine(grad, for_shards=True, grad=torch.is_grad_enabled()), None, None


def global_softmax(local: torch.Tensor, dim: int, combine: Callable, log: bool) -> torch.Tensor:
    """Softmax along the sharded dim from one exchange (``combine``: a ``step.Combining``'s): each rank's maximum and
    its sum of exponentials shifted by it, merged in rank order (the global maximum M, the total sum of exp(x - M)).
    A global maximum, then a global sum, took two exchanges.

    Usage: ``Step(lambda t, combine: global_softmax(t, 2, combine, False), (xs, Combining(comm)), out=xs.spec)``"""
    shape = [1 if d == dim else s for d, s in enumerate(local.shape)]
    acc = sum_dtype(local.dtype)
    wide = local if acc is None else local.to(acc)
    top = wide.detach().amax(dim, keepdim=True) if local.numel() else wide.new_full(shape, -math.inf)
    shift = torch.where(top == -math.inf, 0.0, top)  # NOTE: a part all -inf (masked): its terms are 0, not nan
    own = (wide - shift).exp().sum(dim, keepdim=True)
    tops, sums = combine(torch.stack([top, own.detach()]).double(), how="parts", grad=False).unbind(1)
    peak = tops.amax(0)
    total = (sums * (tops - peak).exp()).sum(0).to(wide.dtype)
    peak = peak.to(wide.dtype)
    if own.requires_grad:  # NOTE: the maximum is a shift softmax does not depend on: only the sums carry gradients
        total = _KnownTotal.apply(own * (shift - peak).exp(), total, combine)
    shifted = wide - peak
    out = shifted - total.log() if log else shifted.exp() / total
    return out if acc is None else out.to(local.dtype)


def _softmax_rule(func, log: bool):
    def rule(input, dim=None, _stacklevel=3, dtype=None):
        if dim is None:
            raise NotImplementedError(f"{op_name(func)} without dim= on a domain tensor: give dim=")
        d = dim % input.ndim
        if dtype is not None:
            input = elementwise(torch.Tensor.to, input, dtype)
        if d != input.spec.dim or input.spec.comm.size == 1:
            return Step(lambda t: func(t, d), (input,), out=input.spec)
        return Step(lambda t, combine: global_softmax(t, d, combine, log), (input, Combining(input.spec.comm)),
                    out=input.spec)

    return rule


for _sm in (F.softmax, torch.softmax, torch.Tensor.softmax):
    register(_sm)(_softmax_rule(_sm, log=False))
for _sm in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax):
    register(_sm)(_softmax_rule(_sm, log=True))


def _loss(elementwise_loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return elementwise_loss
    return domain_reduce(elementwise_loss, "mean" if reduction == "mean" else "sum")


def _pointwise_loss(func, name: str):
    """``F.mse_loss``/``F.l1_loss`` as torch computes them: the legacy ``size_average``/``reduce`` read, and a
    ``weight`` of the input's shape scaling each element (its mean divides by the weights' sum)."""
    def rule(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
        reduction = loss_reduction(name, size_average, reduce, reduction)
        if weight is None:  # NOTE: F.l1_loss's weight never reaches a subclass (ARGUMENTS_TORCH_DROPS)
            weight = argument_torch_dropped(func, "weight")
        losses = elementwise(func, input, target, reduction="none")
        if weight is None:
            return _loss(losses, reduction)
        if tuple(size_of(weight)) != tuple(size_of(input)):
            raise ValueError(f"{name}: weight of shape {tuple(size_of(weight))} must have the input's shape "
                             f"{tuple(size_of(input))} (as torch asks)")
        weighted = call(torch.mul, losses, weight)
        if reduction == "none":
            return weighted
        total = call(torch.sum, weighted)
        return total if reduction == "sum" else call(torch.div, total, call(torch.sum, weight))
    return rule


register(F.mse_loss)(_pointwise_loss(F.mse_loss, "F.mse_loss"))
register(F.l1_loss)(_pointwise_loss(F.l1_loss, "F.l1_loss"))


@register(F.cross_entropy)
def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    reduction = loss_reduction("F.cross_entropy", size_average, reduce, reduction)
    if input.spec.dim is None or input.spec.dim < 2:
        raise NotImplementedError("F.cross_entropy: shard a spatial dim (>= 2) of the (N, C, ...) input, not N or C")
    probabilities = target.is_floating_point()
    want = input.spec.dim if probabilities else input.spec.dim - 1
    if not isinstance(target, DomainTensor) or target.spec.dim != want or target.spec.sizes != input.spec.sizes:
        raise ValueError(
            f"F.cross_entropy: the target must be sharded like the input: domain.shard(target, dim={want}, "
            f"sizes={input.spec.sizes})"
        )
    if reduction != "mean" or probabilities:
        losses = F.cross_entropy(unwrap(input), unwrap(target), weight, ignore_index=ignore_index, reduction="none",
                                 label_smoothing=label_smoothing)
        spec = target.spec if not probabilities else input.spec.with_sizes(input.spec.sizes, dim=want - 1)
        return _loss(adopt(losses, spec), reduction)

    def weighted_mean(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor | None, combine: Callable) -> torch.Tensor:
        losses = F.cross_entropy(x, t, w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
        valid = (t != ignore_index).to(losses.dtype)
        counted = valid if w is None else w[t.clamp(min=0)] * valid
        acc = sum_dtype(losses.dtype)
        return (combine(losses.sum(dtype=acc)) / combine(counted.sum(dtype=acc)).detach()).to(losses.dtype)

    w = Entering(weight) if isinstance(weight, DomainTensor) else weight  # replicated: its gradient summed
    return Step(weighted_mean, (input, target, w, Combining(input.spec.comm)),
                out=DomainSpec.replicated(input.spec.comm))
