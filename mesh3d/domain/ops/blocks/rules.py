"""Op rules for block-sharded tensors (``mesh3d.domain.layouts.blocks``), and the refusal for every other op.

Usage: automatic; ``conv(xs)``, ``F.gelu(xs)``, ``nn.GroupNorm(...)(xs)``, ``(ys - t).square().mean()`` on a
tensor from ``domain.shard(x, dims=(2, 3))``. Any op without a rule here raises ``NotImplementedError``
naming it (the dispatcher reads ``registry.BLOCK_RULES``; a rule written for slabs is never applied to blocks).

What runs on blocks: convolutions (1-D to 3-D, any kernel, stride, dilation and zero padding on every
sharded dim; halos with corners, every neighbour in one round), element-wise ops and activations,
GroupNorm / BatchNorm / InstanceNorm (statistics over the whole domain), sum / mean / prod / amax (max and min of
everything; amin and logsumexp as composites) reductions and the MSE / L1 losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d._torch_private import argument_torch_dropped
from mesh3d.domain.core.specs import BlockSpec, Layout
from mesh3d.domain.core.settings import SETTINGS
from mesh3d.domain.layouts.blocks import layout_gathers, window_plans
from mesh3d.domain.layouts.relayout import blocks_in_layout, turned_blocks
from mesh3d.domain.layouts.blocks_overlap import overlapped_windows
from mesh3d.domain.halo.windows import plan_window
from mesh3d.domain.dispatch.dispatcher import redispatch
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.step import Boxes, LineRows, Narrowed, Relaid, Step
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.ops.composite import loss_reduction
from mesh3d.domain.ops.reduce import total_step
from mesh3d.domain.ops import pointwise
from mesh3d.domain.ops.pointwise import ELEMENTWISE
from mesh3d.domain.dispatch.registry import BLOCK_RULES, op_name
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap

__all__ = ["elementwise_rule", "in_block_layout", "local_reduction", "reduction_rules", "run_elementwise"]

def _spec_of(x: DomainTensor) -> BlockSpec:
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    return spec


# ----------------------------------------------------------------------------- element-wise
def elementwise_rule(func: Callable) -> Callable:
    def rule(*args, **kwargs):
        pointwise.refuse_other_forms(func, args, kwargs)
        operands = [*args, *kwargs.values()]
        tensors = [t for t in operands if isinstance(t, torch.Tensor)]
        blocks = [t for t in tensors if isinstance(t, DomainTensor) and isinstance(t._spec, BlockSpec)]
        ref = blocks[0]
        spec = _spec_of(ref)
        if any(t.ndim != ref.ndim for t in blocks):
            raise ValueError(f"{op_name(func)}: block tensors of different ranks ({[t.ndim for t in blocks]})")

        def local(o):
            if not isinstance(o, torch.Tensor):
                return o
            if any(o is b for b in blocks):  # moved to ref's layout where it differs (a U-Net's two branches, x.mT)
                return in_block_layout(o, spec)
            if isinstance(o, DomainTensor) and o._spec.dim is not None:
                return _slab_in_layout(func, o, ref, spec)
            shape, whole, cuts = size_of(o), ref.shape, []  # a plain or replicated value entering the blocks
            for k, d in enumerate(spec.dims):
                aligned = d - (ref.ndim - o.ndim)
                if aligned < 0 or shape[aligned] == 1:
                    continue
                if shape[aligned] != whole[d]:
                    raise ValueError(
                        f"{op_name(func)}: a tensor of shape {tuple(o.shape)} meets blocks of global shape "
                        f"{tuple(whole)} along the block-sharded dim {d}; give it size 1 or the global length "
                        f"{whole[d]} there (each block then takes its rows), or shard it as blocks too")
                cuts.append((aligned, spec.offsets[k], spec.local_sizes[k]))  # this block's rows of it
            return Narrowed(o, tuple(cuts)) if cuts or isinstance(o, DomainTensor) else o

        return run_elementwise(func, args, kwargs, local, ref, "blocks")
    return rule


def in_block_layout(o: DomainTensor, spec: BlockSpec) -> Any:
    """``o``'s block laid out as ``spec``: itself, or what the executor moves: its rows gathered along the grid lines
    whose sizes differ (``step.LineRows``), or a block turned onto other dims (``x.mT``, rot90) moved over ``spec``'s
    dims (``step.Relaid``); blocks of other global lengths are refused (``blocks_in_layout`` says how)."""
    have = _spec_of(o)
    if have.dims == spec.dims and have.sizes == spec.sizes:
        return o  # NOTE: the call's own tensor, which the executor unwraps: a kept step binds the next call's there
    if have.dims == spec.dims and [sum(s) for s in have.sizes] == [sum(s) for s in spec.sizes]:
        return LineRows(o, layout_gathers(have, spec))
    if turned_blocks(o, spec):
        return Relaid(o, None, spec.dims, spec.sizes)
    return blocks_in_layout(o, spec)


def _slab_in_layout(func: Callable, o: DomainTensor, ref: DomainTensor, spec: BlockSpec) -> Relaid:
    """This block of a slab operand, moved by the executor: a window attention's output (its windows ran on slabs:
    ``layout``'s ``reshape_blocks``) meeting its shortcut."""
    ospec = o._spec
    if o.ndim != ref.ndim or ospec.layout is not Layout.SLAB or ospec.dim not in spec.dims or ospec.comm != spec.comm:
        raise ValueError(f"{op_name(func)}: a tensor sharded as {o._spec.layout.name.lower()} along dim {o._spec.dim} "
                         f"meets blocks over dims {spec.dims}; shard both as blocks")
    return Relaid(o, None, spec.dims, spec.sizes)


def run_elementwise(func: Callable, args: tuple, kwargs: dict, local: Callable[[Any], Any], ref: DomainTensor,
                    layout: str) -> Any:
    """The step of ``func`` on the local operands (``local`` maps each argument: a plain tensor, a domain tensor the
    executor unwraps, or rows it gathers), its result laid out like ``ref``.

    Usage: ``return run_elementwise(torch.add, args, kwargs, local, ref, "blocks")``
    """
    largs, lkwargs = [local(a) for a in args], {k: local(v) for k, v in kwargs.items()}
    keep = tuple(t for t in (*args, *kwargs.values())
                 if isinstance(t, torch.Tensor) and not isinstance(t, DomainTensor))
    ndim = ref.ndim  # NOTE: not ``ref`` itself in the closure: a kept step holds data only

    def compute(*a: Any, **k: Any) -> Any:
        out = func(*a, **k)
        if isinstance(out, torch.Tensor) and out.ndim != ndim:
            raise NotImplementedError(f"{op_name(func)}: on {layout}, the result must keep the input's dims")
        return out

    return Step(compute, tuple(largs), lkwargs, out=ref._spec, keep=keep)


for _f in ELEMENTWISE:
    BLOCK_RULES.register(_f, elementwise_rule(_f))


# ----------------------------------------------------------------------------- convolution
def _ints(v, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _conv_rule(func: Callable, nd: int) -> Callable:
    name = f"torch.nn.functional.conv{nd}d"

    def rule(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if isinstance(weight, DomainTensor) or isinstance(bias, DomainTensor):
            raise NotImplementedError(f"{name}: the weight and bias must be plain (replicated) tensors")
        spec = _spec_of(input)
        first = input.ndim - nd
        if any(d < first for d in spec.dims):
            raise NotImplementedError(f"{name}: on blocks, shard spatial dims (>= {first}) only, got dims {spec.dims}")
        ks, stride, dilation = tuple(weight.shape[2:]), _ints(stride, nd), _ints(dilation, nd)
        if isinstance(padding, str):
            totals = [0 if padding == "valid" else d * (k - 1) for d, k in zip(dilation, ks)]
            pads = [(t // 2, t - t // 2) for t in totals]
        else:
            pads = [(p, p) for p in _ints(padding, nd)]

        def kernel(rows: torch.Tensor, grid_pads: list[tuple[int, int]]) -> torch.Tensor:
            local_pads = list(pads)
            for d, pad in zip(spec.dims, grid_pads):
                local_pads[d - first] = pad
            return _local_conv(func, rows, weight, bias, stride, local_pads, dilation, groups, sharded)

        sharded = [d - first for d in spec.dims]
        windows = [(ks[d - first], stride[d - first], dilation[d - first], *pads[d - first]) for d in spec.dims]
        out = overlapped_windows(unwrap(input), spec, windows, kernel)
        if out is None:
            plans, out_spec = window_plans(spec, first, ks, stride, dilation, pads)
            return Step(lambda local, w, b: _local_conv(func, local, w, b, stride, pads, dilation, groups, sharded),
                        (Boxes(input, plans, 0.0, SETTINGS.value.overlap.blocks), weight, bias), out=out_spec)
        return adopt(out, spec.with_sizes(tuple(plan_window(s, *w).out_sizes for s, w in zip(spec.sizes, windows))))

    return rule


def _local_conv(func: Callable, rows: torch.Tensor, weight, bias, stride: tuple[int, ...], pads: list[tuple[int, int]],
                dilation: tuple[int, ...], groups: int, sharded: list[int]) -> torch.Tensor:
    """The conv on fully extended rows, adding ``pads`` (per spatial dim); zeros tied to the weights where this
    rank owns no output along a ``sharded`` spatial dim (it still takes part in the backward's exchanges)."""
    nd = len(pads)
    shape = [rows.shape[0], weight.shape[0]]
    for i, (lo, hi) in enumerate(pads):
        n = rows.shape[rows.ndim - nd + i] + lo + hi
        shape.append((n - dilation[i] * (weight.shape[2 + i] - 1) - 1) // stride[i] + 1)
    if any(shape[2 + i] <= 0 for i in sharded):
        return connected_zeros(rows, [max(s, 0) for s in shape], rows, weight, bias)
    if all(lo == hi for lo, hi in pads):
        return func(rows, weight, bias, stride, tuple(lo for lo, _ in pads), dilation, groups)
    flat = [v for i in reversed(range(nd)) for v in pads[i]]
    return func(F.pad(rows, flat), weight, bias, stride, 0, dilation, groups)


for _nd, _conv in ((1, F.conv1d), (2, F.conv2d), (3, F.conv3d)):
    BLOCK_RULES.register(_conv, _conv_rule(_conv, _nd))


# ----------------------------------------------------------------------------- reductions and losses
def local_reduction(local: torch.Tensor, kind: str, dims: list[int], keepdim: bool, whole: bool) -> torch.Tensor:
    """``torch.sum`` / ``mean`` / ``amax`` / ``prod`` of this rank's part over ``dims``; ``whole``: ``prod`` was given no dim.

    Usage: ``local_reduction(unwrap(x), "prod", [1], keepdim=False, whole=False)``"""
    if kind == "prod":  # torch.prod takes one dim or none (reduction_rules checked)
        return torch.prod(local) if whole else torch.prod(local, dims[0], keepdim=keepdim)
    return _LOCAL_REDUCTIONS[kind](local, dims, keepdim=keepdim)


_LOCAL_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax}


def _reduce(x: DomainTensor, kind: str, dim=None, keepdim: bool = False) -> Any:
    spec = _spec_of(x)
    dims = list(range(x.ndim)) if dim is None or dim == [] or dim == () else sorted(
        d % x.ndim for d in ([dim] if isinstance(dim, int) else dim))
    if not set(spec.dims) & set(dims):  # the blocks survive: a local reduction
        if not keepdim:  # dims reduced away before the block dims move them left
            spec = type(spec)(tuple(b - sum(d < b for d in dims) for b in spec.dims), spec.sizes, spec.lines, spec.comm)
        whole = dim is None
        return Step(lambda local: local_reduction(local, kind, dims, keepdim, whole), (x,), out=spec)
    if not set(spec.dims) <= set(dims):
        raise NotImplementedError(f"torch.{kind} over dims {dims} covers only some of the block-sharded dims "
                                  f"{spec.dims}: reduce over all of them, or gather with .full_tensor() first")
    # NOTE: prod over every dim (one dim cannot hold all the block dims); the parts combined by the executor
    return total_step(x, kind, dim, dims, keepdim, spec.comm, full_kernel=True)


def _run(out: Any) -> Any:
    """A reducer's answer as a value: its step run (``total_step``), else as it is."""
    return run_step(out) if isinstance(out, Step) else out


def reduction_rules(reducer: Callable[..., Any], layout: str) -> dict[Callable, Callable]:
    """sum / mean / prod / amax (and max / min of everything) and the MSE / L1 loss rules of a layout, from its
    ``reducer(x, "sum" | "mean" | "prod" | "amax", dim, keepdim)`` (``prod``: ``dim`` one int or None, as torch takes it).

    Usage: ``for f, rule in reduction_rules(_reduce, "a token grid").items(): TOKEN_RULES.register(f, rule)``
    """
    def cast(name: str, input, dtype, out):
        """``input`` in ``dtype`` first, as torch reduces in the dtype it is given; ``out=`` refused by name."""
        if out is not None:
            raise NotImplementedError(f"{name}(out=...) is not supported on {layout}; use the result")
        return input if dtype is None else redispatch(torch.Tensor.to, input, dtype)

    def total(input, dim=None, keepdim=False, dtype=None, *, out=None):
        return reducer(cast("torch.sum", input, dtype, out), "sum", dim, keepdim)

    def mean(input, dim=None, keepdim=False, dtype=None, *, out=None):
        return reducer(cast("torch.mean", input, dtype, out), "mean", dim, keepdim)

    def prod(input, dim=None, keepdim=False, *, dtype=None, out=None):
        if not (dim is None or isinstance(dim, int)):
            raise TypeError(f"torch.prod: dim must be one int (torch takes one), got {dim!r}")
        if dim is not None and not -input.ndim <= dim < input.ndim:
            raise IndexError(f"torch.prod: dim={dim} is out of range for a {input.ndim}-D tensor")
        return reducer(cast("torch.prod", input, dtype, out), "prod", dim, keepdim)

    def amax(input, dim=(), keepdim=False, *, out=None):
        return reducer(cast("torch.amax", input, None, out), "amax", dim, keepdim)

    def extreme(name: str, sign: int) -> Callable:
        def rule(input, *args, **kwargs):
            if args or kwargs:
                raise NotImplementedError(
                    f"{name} with dim= or a second tensor on {layout}: use torch.amax(x, dim) / torch.amin(x, dim), or "
                    "torch.maximum(a, b) / torch.minimum(a, b); arg-indices over a sharded dim are not supported")
            if sign > 0:
                return reducer(input, "amax", None, False)
            return redispatch(torch.neg, _run(reducer(redispatch(torch.neg, input), "amax", None, False)))
        return rule

    def loss(func: Callable, name: str, pointwise: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        def rule(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
            reduction = loss_reduction(name, size_average, reduce, reduction)
            if weight is None:  # NOTE: F.l1_loss's weight never reaches a subclass (ARGUMENTS_TORCH_DROPS)
                weight = argument_torch_dropped(func, "weight")
            if weight is not None:
                raise NotImplementedError(f"{name} with weight= on {layout}: multiply the reduction='none' loss by "
                                          "the weights and reduce that")
            difference = redispatch(torch.Tensor.sub, input, target)  # the element-wise rule checks the layouts
            # NOTE: the pointwise op on the domain tensor (its own rule), not adopted from the shard: a compiled
            # graph cannot read the spec of a tensor a rule wrapped itself before a __torch_function__ returns it.
            per_element = redispatch(pointwise, difference)
            return per_element if reduction == "none" else reducer(per_element, reduction)  # a result or a step
        return rule

    return {torch.sum: total, torch.Tensor.sum: total, torch.mean: mean, torch.Tensor.mean: mean,
            torch.prod: prod, torch.Tensor.prod: prod, torch.amax: amax, torch.Tensor.amax: amax,
            torch.max: extreme("torch.max", 1), torch.Tensor.max: extreme("torch.max", 1),
            torch.min: extreme("torch.min", -1), torch.Tensor.min: extreme("torch.min", -1),
            F.mse_loss: loss(F.mse_loss, "F.mse_loss", torch.square),
            F.l1_loss: loss(F.l1_loss, "F.l1_loss", torch.abs)}


for _func, _rule in reduction_rules(_reduce, "blocks").items():
    BLOCK_RULES.register(_func, _rule)
