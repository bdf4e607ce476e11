"""The one executor of rules' steps: resolves a step's requirements (halo rows, row maps, layouts, replicated values
entering), calls its local function on plain tensors and wraps the results; a failure on one rank is told to its peers.

Usage (``dispatch.dispatcher`` runs every rule's step here; a rule that composes others calls ``run_step`` too)::

    out = run_step(Step(torch.relu, (xs,), out=xs.spec))
    out = run_kept(F.conv2d, kept.bind(args, kwargs), spec.comm, journal)    # a kept step (``dispatch.kept``)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import functorch_transform_active
from mesh3d.domain.comm.collectives import (
    all_parts, all_reduce_max, all_reduce_sum, reduce_for_local_use, reduce_to_replicated, sum_grad)
from mesh3d.domain.comm.divergence import JOURNAL, DomainDivergenceError
from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.comm.stopping import report_failure
from mesh3d.domain.comm.peer_lost import DomainPeerLostError
from mesh3d.domain.comm.rows import ExchangePlan, Span, plan_exchange
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import DomainSpec, Layout
from mesh3d.domain.core.settings import SETTINGS, traced
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.registry import op_name
from mesh3d.domain.dispatch.step import (
    AllTokens, Boxes, Combining, Entering, LineRows, Moved, Narrowed, OwnRows, Partial, Pencils, PrefixTokens, Reached,
    Relaid, Resplit, Rows, Step, Whole)
from mesh3d.domain.halo.overlap import OVERLAP_STATS, run_overlapped, split_window
from mesh3d.domain.halo.windows import Extended, Window, WindowProbe, window_exchange
from mesh3d.domain.layouts.blocks import gather_along, gather_planned
from mesh3d.domain.layouts.relayout import relayout
from mesh3d.domain.layouts.slabs import redistribute_local, replicate_if_singleton, strided_rows
from mesh3d.domain.layouts.tokens import gather_all_tokens, prefix_tokens
from mesh3d.domain.layouts.transpose import move_rows
from mesh3d.domain.core.trees import tree_map
from mesh3d.domain.core.wrapped import WrappedDomainTensor

__all__ = ["STEP_TAP", "StepTap", "changes_layout", "combine_parts", "op_label", "resolved", "run_kept", "run_parts",
           "run_step", "telling_peers_of_failure"]


class _Telling(threading.local):
    """How deep this thread is in ops whose failure is told to peers (``telling_peers_of_failure``)."""

    depth = 0


_TELLING = _Telling()


def telling_peers_of_failure(comm: DomainComm, func: Callable | str, run: Callable[[], Any]) -> Any:
    """``run()``; if it fails on this rank, tell every domain peer before raising.

    NOTE: a rank that fails alone would leave its peers waiting in their next exchange: tell them, and
    learn whether the failure is a symptom of the ranks taking different paths (then that error is raised).
    An op a rule calls (a composite's parts) fails through the outermost op's call, which tells the peers once,
    naming the op the user called: a rule never talks itself, its refusals included.
    """
    if _TELLING.depth:
        return run()
    _TELLING.depth += 1
    try:
        return run()
    except (DomainDivergenceError, DomainPeerLostError):  # its peers were told already
        raise
    except Exception as err:
        reported = report_failure(comm, op_label(func), err)
        if reported is err:
            raise
        raise reported from err
    finally:
        _TELLING.depth -= 1


_MOVES = (Window, Rows, Reached, Resplit, Moved, Pencils, LineRows, Boxes, Relaid, Whole, AllTokens)


def changes_layout(step: Step, lead: DomainTensor) -> bool:
    """A step that moves rows or changes the layout (the ones whose divergence would desynchronize exchanges)."""
    if any(isinstance(a, _MOVES) for a in step.args):
        return True
    return step.out is not lead._spec and step.out != lead._spec


_NAMES: dict[Callable, str] = {}


def op_label(func: Callable | str) -> str:
    if type(func) is str:  # NOTE: a name already (a compiled graph's op)
        return func
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = op_name(func)
    return name


class StepTap:
    """The step a rule returned for one call, for ``dispatch.kept`` to keep: armed with the call's ``args`` (by
    identity), it records ``(rule, step, journal entry or None)`` of that call's rule and disarms.

    Usage: ``STEP_TAP.args = args; out = dispatch(...); rule, step, journal = STEP_TAP.take()``
    """

    def __init__(self) -> None:
        self.args: tuple | None = None
        self.taken: tuple | None = None

    def tapped(self, rule: Callable, lead: DomainTensor, layout_journal: Callable[[Any], tuple] | None) -> Callable:
        """``rule``, recording what it returns, and the journal entry the dispatcher records for its call: the
        layout's own (``layout_journal`` of the lead's spec, made before the rule runs: blocks, token grids, graphs),
        else the step's where it changes the layout (slabs)."""
        self.args = None

        def run(*args: Any, **kwargs: Any) -> Any:
            step = rule(*args, **kwargs)
            journal = None
            if layout_journal is not None:
                journal = layout_journal(lead._spec)
            elif isinstance(step, Step) and changes_layout(step, lead):
                out = step.out
                journal = (out.dim, sum(out.sizes)) if out is not None and out.sizes else (None, 0)
            self.taken = (rule, step, journal)
            return step
        return run

    def take(self) -> tuple | None:
        """What was recorded since armed (None: no rule ran for that call), and disarm."""
        taken, self.taken, self.args = self.taken, None, None
        return taken


#: The one step tap of this process (``dispatch.kept``)
STEP_TAP = StepTap()


def run_kept(func: Callable, parts: tuple, comm: DomainComm, journal: tuple | None) -> Any:
    """A kept step of a multi-rank call (``dispatch.kept``: ``run_parts``'s arguments) run as its rule's step runs:
    journaled as its rule's call was, its peers told if it fails here.

    Usage: ``run_kept(F.conv2d, kept.bind(args, kwargs), spec.comm, journal)``
    """
    if journal is not None:
        JOURNAL.record(op_label(func), journal)
    return telling_peers_of_failure(comm, func, lambda: run_parts(*parts))


def _rows(req: Rows) -> torch.Tensor:
    spec = req.x._spec
    return gather_rows(unwrap(req.x), spec.dim, plan_exchange(spec.sizes, req.needs, spec.comm.index), spec.comm,
                       req.fill)


def _reached(req: Reached) -> torch.Tensor:
    """NOTE: one all-reduce of every rank's (first, last), a rank that reads nothing adding (0, -1): then each knows
    what its peers read from it."""
    spec = req.x._spec
    extents = torch.zeros(spec.comm.size, 2, dtype=torch.int64)
    extents[spec.comm.index] = torch.tensor([req.first, req.last])
    needs = tuple((Span.rows(a, b + 1),) if b >= a else () for a, b in all_reduce_sum(extents, spec.comm).tolist())
    return _rows(Rows(req.x, needs))


def _line_rows(req: LineRows) -> torch.Tensor:
    local, spec = unwrap(req.x), req.x._spec
    for axis, needs in req.gathers:
        local = gather_along(local, spec, axis, needs)
    return local


def _entering(x: Any) -> Any:
    """A plain operand as it is; a replicated domain tensor's local value, its gradient summed over the domain."""
    if not isinstance(x, DomainTensor):
        return x
    plain = unwrap(x)
    return sum_grad(plain, x._spec.comm) if plain.requires_grad else plain


def _narrowed(req: Narrowed) -> torch.Tensor:
    part = _entering(req.x)
    for dim, start, length in req.cuts:
        part = part.narrow(dim, start, length)
    return part


def combine_parts(comm: DomainComm, part: torch.Tensor, how: str = "sum", for_shards: bool = False,
                  grad: bool = True) -> torch.Tensor:
    """This rank's ``part`` of a value combined with its peers' over ``comm`` (``step.Combining``, ``step.Partial``);
    ``grad=False``: a plain sum in rank order, no autograd node (inside an autograd Function's forward or backward);
    ``how="parts"``: every rank's part stacked in rank order, no autograd node (a variance's count, mean and spread);
    ``how="enter"``: a replicated ``part`` as it is, entering each rank's shard (its gradient summed over the domain).

    Usage: ``total = combine_parts(spec.comm, t.sum(2, keepdim=True), for_shards=True)``
    """
    if how == "max":
        return all_reduce_max(part, comm)
    if how == "parts":
        return all_parts(part, comm)
    if how == "enter":
        return sum_grad(part, comm)
    if how != "sum":
        raise ValueError(f"combine: how={how!r} is 'sum', 'max', 'parts' or 'enter'")
    if not grad:
        return all_reduce_sum(part, comm)
    return reduce_for_local_use(part, comm) if for_shards else reduce_to_replicated(part, comm)


#: How each requirement of ``step`` resolves to a plain tensor. NOTE: looked up by exact type (the requirements are
#: final dataclasses): a plain argument (a weight, a bias, a number), the common case, costs one lookup.
_RESOLVERS: dict[type, Callable[[Any], Any]] = {
    Window: lambda req: _window_rows(req, *window_exchange(req.x._spec.sizes, req.plan, req.x._spec.comm.index,
                                                           req.kernel_pads)),
    Rows: _rows,
    Reached: _reached,
    Resplit: lambda req: redistribute_local(req.x, req.sizes),
    Moved: lambda req: move_rows(unwrap(req.x), req.x._spec.comm, req.x._spec.dim, req.x._spec.sizes, req.dim,
                                 req.sizes),
    LineRows: _line_rows,
    AllTokens: lambda req: gather_all_tokens(unwrap(req.x), req.x._spec),
    PrefixTokens: lambda req: prefix_tokens(unwrap(req.x), req.x._spec, req.start, req.stop),
    Whole: lambda req: unwrap(req.x.full_tensor()),
    Relaid: lambda req: unwrap(relayout(req.x, req.dim, req.dims, req.sizes)),
    Boxes: lambda req: gather_planned(unwrap(req.x), req.x._spec, req.plans, req.fill, req.passes),
    Pencils: lambda req: _along_lines(unwrap(req.x), req.moves),
    Entering: lambda req: _entering(req.x),
    OwnRows: lambda req: strided_rows(_entering(req.x), req.dim, req.spec),
    Narrowed: _narrowed,
    Combining: lambda req: functools.partial(combine_parts, req.comm),
}


def resolved(req: Any) -> Any:
    """One requirement (``step.Entering``, ``step.Rows``, ...) resolved as a step's argument is; the executor's own
    resolution of every step argument, and for a rule that writes into a tensor in place (no step to run).

    Usage: ``unwrap(target)[index] = resolved(Entering(value))``
    """
    if isinstance(req, DomainTensor):
        return unwrap(req)
    resolver = _RESOLVERS.get(type(req))
    return req if resolver is None else resolver(req)


def _along_lines(local: torch.Tensor, moves: tuple) -> torch.Tensor:
    """``local`` with ``step.Pencils``' moves run in order, each an all-to-all on its grid line."""
    for line, src, src_sizes, dst, dst_sizes in moves:
        local = move_rows(local, line, src, src_sizes, dst, dst_sizes)
    return local


def _window_rows(req: Window, xplan: ExchangePlan, pad: int) -> Extended:
    """A window's input rows (its exchange ``xplan``, ``window_exchange``'s), and the padding left to the kernel."""
    spec = req.x._spec
    if WindowProbe.active:
        WindowProbe.note(sum(spec.sizes), sum(req.plan.out_sizes))
    return Extended(gather_rows(unwrap(req.x), spec.dim, xplan, spec.comm, req.fill), pad)


def _overlapped(compute: Callable, req: Window, xplan: ExchangePlan, pad: int, rest: tuple,
                kwargs: dict) -> torch.Tensor | None:
    """The step's result computed with its halo exchange in flight (``mesh3d.domain.halo.overlap``), or None
    where that does not apply: overlap off or not declared, nothing received, or no interior rows. The window is the
    step's first argument; the others (a weight, a bias) are passed to each strip's call as they are."""
    # NOTE: the setting read first, as before any other check: a compiled graph guards on it (a change recompiles)
    if not SETTINGS.value.overlap.enabled or traced() or req.overlap is None or req.x._spec.comm.size == 1 or \
            not xplan.recv or functorch_transform_active():
        return None  # NOTE: under torch.func, its two autograd Functions share a state the transform cannot carry
    if any(isinstance(a, _MOVES) for a in rest) or any(isinstance(v, _MOVES) for v in kwargs.values()):
        return None
    spec = req.x._spec
    split = split_window(xplan, pad, *req.overlap, req.plan.out_sizes[spec.comm.index])
    if split is None:
        return None
    if WindowProbe.active:
        WindowProbe.note(sum(spec.sizes), sum(req.plan.out_sizes))
    OVERLAP_STATS.calls += 1
    if rest or kwargs:
        rest = tuple(resolved(a) for a in rest)
        kwargs = {k: resolved(v) for k, v in kwargs.items()}
        strip_compute = compute

        def compute(ext: Extended) -> Any:
            return strip_compute(ext, *rest, **kwargs)
    return run_overlapped(compute, unwrap(req.x), spec.dim, xplan, split, spec.comm, req.fill)


def run_step(step: Step) -> Any:
    """Resolve a rule's requirements, call its local function and wrap the results.

    Usage: ``run_step(Step(torch.relu, (xs,), out=xs.spec))``
    """
    return run_parts(step.compute, step.args, step.kwargs, step.out, step.out_ndim, step.keep, step.partial,
                     step.laid_out_as)


def _combined(out: Any, partial: Partial, spec: Any) -> Any:
    """A partial step's local results (``step.Partial``) combined over ``spec``'s domain and finished."""
    comm = spec.comm if partial.over is None else partial.over
    out = tree_map(lambda o: combine_parts(comm, o, partial.combine, partial.for_shards)
                   if isinstance(o, torch.Tensor) else o, out)
    return out if partial.then is None else partial.then(out)


def _operand(a: Any, entering: bool) -> Any:
    """A step argument as its function takes it (``run_parts``' NOTE on a replicated one)."""
    if type(a) is WrappedDomainTensor:
        spec = a._spec
        return _entering(a) if entering and type(spec) is DomainSpec and spec.dim is None else a._differentiable_local()
    if entering and isinstance(a, DomainTensor) and a._spec.layout is Layout.REPLICATED:
        return _entering(a)
    return resolved(a)


def run_parts(compute: Callable, args: tuple, kwargs: dict, spec: Any, out_ndim: int | None, keep: tuple,
              partial: Partial | None = None, laid_out_as: Any = None) -> Any:
    """``run_step`` of a step given as its fields (a kept step's, ``dispatch.kept``: no ``Step`` made per call).

    Usage: ``run_parts(torch.relu, (xs,), {}, xs.spec, None, ())``
    """
    first = args[0] if args else None
    # NOTE: a replicated domain tensor passed as it is to the step of a sharded or partial result is used whole by
    # every rank's part of it: it enters as ``Entering`` (its gradient summed over the domain, as one process sums it
    # over every row), whether or not the rule said so. A replicated result is each rank's whole: nothing to sum.
    entering = partial is not None or (spec is not None and spec.layout is not Layout.REPLICATED)
    kwargs = {k: _operand(v, entering) for k, v in kwargs.items()} if kwargs else {}
    if type(first) is Window:  # NOTE: its exchange planned once, whether the interior overlaps it or not
        x_spec = first.x._spec
        xplan, pad = window_exchange(x_spec.sizes, first.plan, x_spec.comm.index, first.kernel_pads)
        out = _overlapped(compute, first, xplan, pad, args[1:], kwargs)
        if out is None:
            out = compute(_window_rows(first, xplan, pad), *[_operand(a, entering) for a in args[1:]], **kwargs)
    else:
        out = compute(*[_operand(a, entering) for a in args], **kwargs)
    if partial is not None:
        out = _combined(out, partial, spec)
    if type(laid_out_as) is Pencils:  # NOTE: blocks moved back along their grid lines
        out = tree_map(lambda o: _along_lines(o, laid_out_as.moves) if isinstance(o, torch.Tensor) else o, out)
    elif laid_out_as is not None:  # NOTE: moved to ``spec``'s dim and sizes (``step.Moved``'s way back)
        out = tree_map(lambda o: move_rows(o, spec.comm, laid_out_as.dim, laid_out_as.sizes, spec.dim, spec.sizes)
                       if isinstance(o, torch.Tensor) else o, out)
    if spec is None:
        return out
    # A result whose sharded dim has global length 1 becomes replicated (gather.replicate_if_singleton).
    # NOTE: a replicated result is not asked: under torch.func, ``adopt`` hands it back plain (``core.wrapped``)
    sharded = type(spec) is DomainSpec and spec.dim is not None  # NOTE: a slab's (blocks and tokens have no such rule)
    if isinstance(out, torch.Tensor):
        if out_ndim is None or out.ndim == out_ndim:
            made = adopt(out, spec, keep)
            return replicate_if_singleton(made) if sharded else made
        return out
    return tree_map(lambda o: (replicate_if_singleton(adopt(o, spec, keep)) if sharded else adopt(o, spec, keep))
                    if isinstance(o, torch.Tensor) and (out_ndim is None or o.ndim == out_ndim) else o, out)
