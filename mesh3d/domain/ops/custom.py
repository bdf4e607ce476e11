"""Rules for custom ops in a few lines: element-wise, local along the unsharded dims, a window along one dim (its halo
travels), or the whole dim gathered.

Usage::

    domain.register(torch.ops.mylib.act, domain.elementwise())                 # out[i] from in[i] (broadcasting)
    domain.register(torch.ops.mylib.mix, domain.local(dims=(1,)))              # mixes channels only
    domain.register(torch.ops.mylib.blur, domain.window(dim=-1, kernel=5, padding=2, periodic=True))
    domain.register(torch.ops.mylib.spectral, domain.whole_dim(dims=(-1,)))    # needs every row of the dim

A library's kernel knows nothing of the domain: called on a shard it would compute the shard's answer. These helpers
say what the op reads, and mesh3d brings it the rows it needs (through the same differentiable exchanges as its own
rules, so the op's own backward is exact too) or refuses where the description does not fit the call:

* ``elementwise()``: every output element from the inputs' elements at the same index; any layout, graphs included.
* ``local(dims)``: the op mixes values along ``dims`` of its first tensor only (and keeps the tensor's shape along the
  others): exact on the shard when no sharded dim is among them (a graph tensor's features, its items never), refused
  when one is (use ``whole_dim`` then).
* ``window(dim, kernel, stride, dilation, padding, periodic)``: output row ``j`` along ``dim`` reads input rows
  ``j * stride - padding + t * dilation``, ``t < kernel``, rows beyond the ends being zeros (or the rows wrapped round
  when ``periodic``): the op's own padding. Each rank gets its rows with a halo from its neighbours, computes and keeps
  the outputs it owns; slabs and blocks. ``kernel`` and the others may be functions of the call's arguments
  (``kernel=lambda x, w: w.shape[-1]``).
* ``whole_dim(dims)``: every row of the sharded dims among ``dims`` is gathered, the op runs on them, and each rank
  keeps its rows of the output (or the whole output, replicated, when the op changes that dim's length); slabs, and
  blocks when the output keeps the dim.

Each helper's rules check the layout they are given and raise ``NotImplementedError`` naming the op where it does not
apply (a strided slab or a token grid for a window), never computing a local answer for a global question.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mesh3d.domain.comm.collectives import scale_grad
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.specs import BlockSpec, DomainSpec, Layout
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.layout_registry import LAYOUTS
from mesh3d.domain.dispatch.executor import resolved
from mesh3d.domain.dispatch.registry import op_name
from mesh3d.domain.dispatch.step import Entering, LineRows, Rows
from mesh3d.domain.halo.windows import plan_window
from mesh3d.domain.ops import pointwise, strided
from mesh3d.domain.ops.blocks import rules as block_rules
from mesh3d.domain.ops.graph import pointwise as graph_pointwise
from mesh3d.domain.ops.graph.common import graph_spec_of
from mesh3d.domain.ops.tokens import rules as token_rules

__all__ = ["CustomRule", "elementwise", "local", "whole_dim", "window"]

IntOrCall = int | Callable[..., int]


class CustomRule:
    """A rule for a custom op, per layout: ``rules(func)`` maps rule-table names to rules (``domain.register`` uses it).

    Usage: ``domain.register(torch.ops.mylib.op, domain.window(dim=-1, kernel=3, padding=1))``
    """

    def rules(self, func: Callable) -> dict[str, Callable]:
        raise NotImplementedError


def _value(v: Any, args: tuple, kwargs: dict) -> Any:
    return v(*args, **kwargs) if callable(v) else v


def _first(args: tuple, kwargs: dict) -> DomainTensor:
    return next(t for t in (*args, *kwargs.values()) if isinstance(t, DomainTensor) and t._spec.layout is not
                Layout.REPLICATED)


def _norm(dims: Sequence[int], ndim: int, func: Callable) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"{op_name(func)}: dim {d} of its rule is out of range for a {ndim}-D input")
        out.append(d % ndim)
    return tuple(out)


def _plain_args(func: Callable, ref: DomainTensor, args: tuple, kwargs: dict,
                swap: Callable[[DomainTensor], torch.Tensor] | None = None) -> tuple[tuple, dict]:
    """Local arguments: ``ref``'s layout as ``swap`` gives it (default: the shard), replicated domain values entering
    the shards (their gradient summed over the domain), plain tensors as they are unless they vary along a sharded dim."""
    spec, sharded = ref._spec, ref._spec.sharded_dims

    def one(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if isinstance(o, DomainTensor) and o._spec.layout is not Layout.REPLICATED:
            if o._spec != spec or o.ndim != ref.ndim:
                raise NotImplementedError(f"{op_name(func)}: its domain-tensor arguments must be laid out alike "
                                          f"({o._spec} vs {spec}); shard them alike, or register a full rule")
            return swap(o) if swap is not None else unwrap(o)
        plain = resolved(Entering(o)) if isinstance(o, DomainTensor) else o  # a replicated one's gradient summed
        for d in sharded if plain.ndim == ref.ndim else ():  # NOTE: lower-rank tensors are taken as weights
            if size_of(o)[d] != 1 and size_of(o)[d] == size_of(ref)[d]:
                raise NotImplementedError(
                    f"{op_name(func)}: a plain tensor of shape {tuple(plain.shape)} varies along dim {d}, which is "
                    "sharded over the domain: shard it alike with domain.shard, or register a full rule")
        return plain

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _wrap_outputs(func: Callable, out: Any, ref: DomainTensor, spec: Any, keep: tuple) -> Any:
    """Tensor outputs laid out as ``spec`` (they must keep ``ref``'s rank); anything else is refused."""
    def one(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if o.ndim != ref.ndim:
            raise NotImplementedError(
                f"{op_name(func)} returned a {o.ndim}-D tensor for a {ref.ndim}-D domain tensor: its rule's "
                "description (domain.elementwise/local/window/whole_dim) does not fit; register a full rule")
        return adopt(o, spec, keep)
    if isinstance(out, (tuple, list)):
        return type(out)(one(o) for o in out)
    return one(out)


def _keep(args: tuple, kwargs: dict) -> tuple:
    return tuple(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and not isinstance(t, DomainTensor))


def _call(func: Callable, args: tuple, kwargs: dict, ndim: int, probe: dict[int, int] | None = None) -> Any:
    """``func`` on local arguments. NOTE: on an empty shard (a dim of length 0 in the tensors of the domain tensor's
    rank) a library's kernel may fail where the one-process call cannot: it runs on zeros with those dims at
    ``probe[dim]`` (default 1) instead, and its outputs are cut back to length 0 there, tied to the inputs in autograd
    (the rank still joins every exchange's backward)."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    zero = sorted({d for t in tensors if t.ndim == ndim for d in range(ndim) if t.shape[d] == 0})
    if not zero:
        return func(*args, **kwargs)
    lengths = {d: (probe or {}).get(d, 1) for d in zero}

    def stand_in(o: Any) -> Any:
        if not isinstance(o, torch.Tensor) or o.ndim != ndim or all(o.shape[d] for d in zero):
            return o
        return o.new_zeros([lengths[d] if d in lengths and o.shape[d] == 0 else n for d, n in enumerate(o.shape)])

    sample = func(*(stand_in(a) for a in args), **{k: stand_in(v) for k, v in kwargs.items()})

    def cut(o: Any) -> Any:
        if not isinstance(o, torch.Tensor) or o.ndim != ndim:
            return o
        return connected_zeros(o, [0 if d in lengths else n for d, n in enumerate(o.shape)], *tensors)
    return type(sample)(cut(o) for o in sample) if isinstance(sample, (tuple, list)) else cut(sample)


# ----------------------------------------------------------------------------- element-wise, local
@dataclass(frozen=True)
class _Elementwise(CustomRule):
    def rules(self, func: Callable) -> dict[str, Callable]:
        return {"RULES": pointwise.elementwise_rule(func), "STRIDED_RULES": strided.elementwise_rule(func),
                "BLOCK_RULES": block_rules.elementwise_rule(func), "TOKEN_RULES": token_rules.elementwise_rule(func),
                "GRAPH_RULES": graph_pointwise.elementwise_rule(func)}


def elementwise() -> CustomRule:
    """An op whose every output element comes from the inputs' elements at the same index (broadcasting allowed).

    Usage: ``domain.register(torch.ops.mylib.act, domain.elementwise())``
    """
    return _Elementwise()


@dataclass(frozen=True)
class _Local(CustomRule):
    dims: tuple[int, ...]

    def rules(self, func: Callable) -> dict[str, Callable]:
        def rule(*args, **kwargs):
            ref = _first(args, kwargs)
            acts = _norm(self.dims, ref.ndim, func)
            hit = [d for d in ref._spec.sharded_dims if d in acts]
            if hit:
                raise NotImplementedError(
                    f"{op_name(func)} mixes values along dims {acts} (its rule: domain.local), and dim {hit[0]} is "
                    "sharded over the domain: register it with domain.whole_dim(...) to gather that dim, shard "
                    "another dim, or call it on .full_tensor()")
            local_args, local_kwargs = _plain_args(func, ref, args, kwargs)
            # NOTE: on a graph the output's values are new: an edge-list row's endpoint (what keeps x[src] local) goes.
            spec = graph_spec_of(ref).replaced(endpoint=None) if ref._spec.layout is Layout.GRAPH else ref._spec
            return _wrap_outputs(func, _call(func, local_args, local_kwargs, ref.ndim), ref, spec, _keep(args, kwargs))
        return {table.name: rule for table in LAYOUTS.tables()}  # NOTE: one rule reads every layout's spec


def local(dims: Sequence[int]) -> CustomRule:
    """An op that mixes values along ``dims`` of its first tensor only, the tensor's shape kept along the others.

    Usage: ``domain.register(torch.ops.mylib.mix_channels, domain.local(dims=(1,)))``
    """
    return _Local(tuple(dims))


# ----------------------------------------------------------------------------- window
def _window_rows(lo: int, hi: int, n: int, periodic: bool) -> tuple[Span, ...]:
    """Global rows ``lo..hi`` (inclusive) of a dim of length ``n`` as runs: beyond the ends, zeros or wrapped rows."""
    out: list[Span] = []
    g = lo
    while g <= hi:
        if 0 <= g < n:
            length = min(hi + 1, n) - g
            out.append(Span.rows(g, g + length))
        elif periodic:
            start = g % n
            length = min(n - start, hi + 1 - g, -g if g < 0 else n)
            out.append(Span.rows(start, start + length))
        else:
            length = (min(hi + 1, 0) if g < 0 else hi + 1) - g
            out.append(Span.fill(length))
        g += length
    return tuple(out)


@dataclass(frozen=True)
class _WindowPlan:
    out_sizes: tuple[int, ...]
    needs: tuple[tuple[Span, ...], ...]
    skip: tuple[int, ...]  # per rank: outputs of its local call before its first own one


def _plan(sizes: tuple[int, ...], k: int, s: int, d: int, pl: int, pr: int, periodic: bool) -> _WindowPlan:
    """Each rank's outputs (ownership as a conv's: ``plan_window``), the rows its local call reads, and how many of that
    call's outputs come before its own. NOTE: the call starts ``ceil(pl / s)`` windows early, at a multiple of the
    stride, so its own padding lands only in outputs that are cut off."""
    n = sum(sizes)
    out_sizes = plan_window(sizes, k, s, d, pl, pr).out_sizes
    early = -(-pl // s)
    needs, skip = [], []
    for a, count in zip(offsets_of(out_sizes), out_sizes):
        if count == 0:
            needs.append(())
            skip.append(0)
            continue
        needs.append(_window_rows((a - early) * s, (a + count - 1) * s - pl + d * (k - 1), n, periodic))
        skip.append(early)
    return _WindowPlan(out_sizes, tuple(needs), tuple(skip))


@dataclass(frozen=True)
class _Window(CustomRule):
    dim: int
    kernel: IntOrCall
    stride: IntOrCall
    dilation: IntOrCall
    padding: Any
    periodic: bool | Callable[..., bool]

    def _params(self, func: Callable, args: tuple, kwargs: dict) -> tuple[int, int, int, int, int]:
        k, s, d = (_value(v, args, kwargs) for v in (self.kernel, self.stride, self.dilation))
        pad = _value(self.padding, args, kwargs)
        pl, pr = (pad, pad) if isinstance(pad, int) else tuple(pad)
        if min(k, s, d) < 1 or min(pl, pr) < 0:
            raise ValueError(f"{op_name(func)}: its window rule needs kernel, stride, dilation >= 1 and padding >= 0; "
                             f"got kernel={k}, stride={s}, dilation={d}, padding=({pl}, {pr})")
        return k, s, d, pl, pr

    def _run(self, func: Callable, args: tuple, kwargs: dict, ref: DomainTensor, dim: int, sizes: tuple[int, ...],
             line: Any, out_spec: Callable[[tuple[int, ...]], Any]) -> Any:
        k, s, d, pl, pr = self._params(func, args, kwargs)
        plan = _plan(sizes, k, s, d, pl, pr, bool(_value(self.periodic, args, kwargs)))
        me, count = line.index, plan.out_sizes[line.index]
        local_args, local_kwargs = _plain_args(func, ref, args, kwargs, swap=lambda o: _rows_of(o, dim, plan.needs))
        # NOTE: a rank that owns no output gets no rows; it still joins the exchanges (and their backward)
        out = _call(func, local_args, local_kwargs, ref.ndim, {dim: d * (k - 1) + 1 + pl + pr})
        if count:
            cut = (lambda o: o.narrow(dim, plan.skip[me], count) if isinstance(o, torch.Tensor) else o)
            out = type(out)(cut(o) for o in out) if isinstance(out, (tuple, list)) else cut(out)
        return _wrap_outputs(func, out, ref, out_spec(plan.out_sizes), _keep(args, kwargs))

    def rules(self, func: Callable) -> dict[str, Callable]:
        def slab(*args, **kwargs):
            ref = _first(args, kwargs)
            spec = ref._spec
            dim = _norm((self.dim,), ref.ndim, func)[0]
            if spec.dim != dim:  # the window runs along an unsharded dim: local
                return _Local((dim,)).rules(func)["RULES"](*args, **kwargs)
            return self._run(func, args, kwargs, ref, dim, spec.sizes, spec.comm, lambda out: spec.with_sizes(out))

        def blocks(*args, **kwargs):
            ref = _first(args, kwargs)
            spec = ref._spec
            assert isinstance(spec, BlockSpec)
            dim = _norm((self.dim,), ref.ndim, func)[0]
            if dim not in spec.dims:
                return _Local((dim,)).rules(func)["BLOCK_RULES"](*args, **kwargs)
            axis = spec.dims.index(dim)

            def out_spec(out_sizes):
                return spec.with_sizes(tuple(out_sizes if i == axis else s for i, s in enumerate(spec.sizes)))
            return self._run(func, args, kwargs, ref, dim, spec.sizes[axis], spec.lines[axis], out_spec)

        return {"RULES": slab, "BLOCK_RULES": blocks}


def window(dim: int, kernel: IntOrCall, stride: IntOrCall = 1, dilation: IntOrCall = 1,
           padding: int | tuple[int, int] | Callable[..., Any] = 0, periodic: bool | Callable[..., bool] = False
           ) -> CustomRule:
    """An op that slides a window along ``dim``: output row ``j`` reads input rows ``j * stride - padding + t *
    dilation`` (``t < kernel``), rows beyond the ends being zeros, or wrapped round when ``periodic``.

    Usage: ``domain.register(torch.ops.mylib.blur, domain.window(dim=-1, kernel=lambda x, w: w.shape[-1], padding=2))``
    """
    return _Window(dim, kernel, stride, dilation, padding, periodic)


# ----------------------------------------------------------------------------- the whole dim
@dataclass(frozen=True)
class _WholeDim(CustomRule):
    dims: tuple[int, ...] | None

    def rules(self, func: Callable) -> dict[str, Callable]:
        def slab(*args, **kwargs):
            ref = _first(args, kwargs)
            spec = ref._spec
            acts = range(ref.ndim) if self.dims is None else _norm(self.dims, ref.ndim, func)
            if spec.dim not in acts:
                return _Local(tuple(acts)).rules(func)["RULES"](*args, **kwargs)
            return _whole(func, args, kwargs, ref, spec.dim, spec.sizes, spec.comm,
                          lambda: spec, lambda: DomainSpec.replicated(spec.comm))

        def blocks(*args, **kwargs):
            ref = _first(args, kwargs)
            spec = ref._spec
            assert isinstance(spec, BlockSpec)
            acts = range(ref.ndim) if self.dims is None else _norm(self.dims, ref.ndim, func)
            hit = [i for i, d in enumerate(spec.dims) if d in acts]
            if not hit:
                return _Local(tuple(acts)).rules(func)["BLOCK_RULES"](*args, **kwargs)
            if len(hit) > 1:
                raise NotImplementedError(f"{op_name(func)} needs the whole of several block-sharded dims "
                                          f"{[spec.dims[i] for i in hit]}: move it to slabs with domain.redistribute "
                                          "first, or call it on .full_tensor()")
            axis = hit[0]

            def refuse():
                raise NotImplementedError(f"{op_name(func)} changes the length of block-sharded dim {spec.dims[axis]}: "
                                          "move to slabs first (domain.redistribute), or call it on .full_tensor()")
            return _whole(func, args, kwargs, ref, spec.dims[axis], spec.sizes[axis], spec.lines[axis],
                          lambda: spec, refuse)

        return {"RULES": slab, "BLOCK_RULES": blocks}


def _rows_of(o: DomainTensor, dim: int, needs: tuple) -> torch.Tensor:
    """Rows ``needs`` (a row map per rank of the grid line along ``dim``) of ``o``, gathered by the executor: a slab's
    (``step.Rows``), a block tensor's along one grid line (``step.LineRows``)."""
    spec = o._spec
    if isinstance(spec, BlockSpec):
        return resolved(LineRows(o, ((spec.dims.index(dim), needs),)))
    return resolved(Rows(o, needs))


def _whole(func: Callable, args: tuple, kwargs: dict, ref: DomainTensor, dim: int, sizes: tuple[int, ...], line: Any,
           same: Callable[[], Any], reduced: Callable[[], Any]) -> Any:
    """``func`` on every row of ``dim``; this rank's rows of an output of the same length, else the whole output."""
    n = sum(sizes)
    everything = ((Span.rows(0, n),),) * len(sizes)
    local_args, local_kwargs = _plain_args(func, ref, args, kwargs, swap=lambda o: _rows_of(o, dim, everything))
    out = _call(func, local_args, local_kwargs, ref.ndim)
    lead = out[0] if isinstance(out, (tuple, list)) else out
    if lead.ndim == ref.ndim and lead.shape[dim] == n:
        start, count = offsets_of(sizes)[line.index], sizes[line.index]
        mine = (lambda o: o.narrow(dim, start, count) if isinstance(o, torch.Tensor) else o)
        out = type(out)(mine(o) for o in out) if isinstance(out, (tuple, list)) else mine(out)
        return _wrap_outputs(func, out, ref, same(), _keep(args, kwargs))
    # NOTE: every rank computed the same whole output; each keeps 1/D of its gradient, which the gather's backward
    # then sums over the ranks (the replicated convention of mesh3d's own reductions).
    spec = reduced()
    scale = (lambda o: scale_grad(o, 1.0 / line.size) if isinstance(o, torch.Tensor) and o.requires_grad else o)
    out = type(out)(scale(o) for o in out) if isinstance(out, (tuple, list)) else scale(out)
    wrap_one = (lambda o: adopt(o, spec, _keep(args, kwargs)) if isinstance(o, torch.Tensor) else o)
    return type(out)(wrap_one(o) for o in out) if isinstance(out, (tuple, list)) else wrap_one(out)


def whole_dim(dims: Sequence[int] | None = None) -> CustomRule:
    """An op that needs every row of ``dims`` (None: of every dim): the sharded one is gathered first.

    Usage: ``domain.register(torch.ops.mylib.spectral_filter, domain.whole_dim(dims=(-2, -1)))``
    """
    return _WholeDim(None if dims is None else tuple(dims))
