"""Calls on wrapper tensors whose signature was seen: the rule's answer kept, so the dispatcher's walk runs once.

The one fast path of wrapper tensors (issue 66): the first call of a signature takes the dispatcher, and what its rule
answered is kept; a later call of that signature skips the walk and the rule:

* on a one-rank domain, where the shard *is* the whole tensor, a ruled function's answer is torch's on the shard: what
  the rule adds is only the layout of the results (domain tensors, with what spec). The layout is kept, and a later
  call runs the function on the shards (autograd records it on their differentiable aliases, as a rule's step is
  recorded) and lays the results out the same way;
* on any domain, a rule's step that holds nothing but the call's own tensors and plain data is kept as a template of
  the call's arguments (``kept_steps``), for the rules that plan from metadata alone (element-wise ops, views,
  convolutions, pooling, norms, reductions ...): a later call binds its tensors into it, and the executor runs it as
  the dispatcher runs a rule's step (its halo exchanges, its journal entry on a multi-rank domain, its peers told of
  a failure). A view's one-process answer (strides, offset, a refusal) is kept with it on every domain.

A signature is the function, the rule tables' version (a rule registered or dropped since starts afresh), grad mode,
and every argument: a wrapper tensor's spec, shard shape and strides, its own strides and storage offset, dtype and
``requires_grad``; a plain tensor's type, shape, strides, dtype, device and ``requires_grad``; any other value as
itself (ints, floats, strings, dtypes, None, tuples of them). An argument of any other kind (a storage domain tensor,
a DTensor, a list of lists, an object) takes the dispatcher; so do blocks and token grids on one rank, and graphs on
more than one (their rules read the edges' values). On one rank a graph call is kept where its rule declares its
results' layout to follow from metadata (``kept_steps.layout_rule``: gathers, views, element-wise ops, reductions,
factories; not masks, whose kept items follow from their values, nor counts).

Never kept (each takes the dispatcher every time): a write (``add_``, ``out=``, ``inplace=True``); metadata, sizes and
gradient calls (answered before); random draws and attention (a rule there draws from mesh3d's streams); a rule of
the user's own; calls while a ``WindowProbe`` reads what the rules plan (``domain.downsampling_factor``); a tensor
made as a copied view or having one; on a multi-rank domain a call passing one tensor in two places (``(x, x)``:
the next call of its signature keeps its own step); on a one-rank domain a result other than tensors or one tuple of
them, or whose length along its sharded dim is not its spec's (a data-dependent size, as ``nonzero``'s). While torch.compile
traces, the dispatcher runs the rules.

Usage (``mesh3d.domain`` installs it for wrapper tensors)::

    WrappedDomainTensor._dispatcher = staticmethod(KEPT.dispatch)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.compiler import is_compiling

from mesh3d._torch_private import ARGUMENTS_TORCH_DROPS, disable_torch_function_subclass, is_operator
from mesh3d.domain.core.copied_views import has_copy_marks
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.settings import SETTINGS, DomainSettings
from mesh3d.domain.core.shard_owners import SHARD_OWNERS
from mesh3d.domain.core.specs import Layout
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.wrapped import WrappedDomainTensor, fresh_wrapper
from mesh3d.domain.dispatch.dispatcher import dispatch
from mesh3d.domain.dispatch.executor import STEP_TAP, run_kept, run_parts
from mesh3d.domain.dispatch.elementwise_plan import ELEMENTWISE_PLANS
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.layout_registry import LAYOUTS
from mesh3d.domain.dispatch.kept_steps import (
    KeptStep, keeps_layout, may_keep_layout, may_plan_from_metadata, passes_one_tensor_twice, plans_from_metadata,
    template_of)
from mesh3d.domain.dispatch.queries import DATA_QUERIES, is_global_size, is_metadata
from mesh3d.domain.dispatch.registry import (
    RULES, STRIDED_RULES, RuleTable, inplace_position, writes_inplace, writes_into_first)
from mesh3d.domain.dispatch.signatures import ONE_RANK_GRAPHS, PLAIN, Unkept, signature
from mesh3d.domain.dispatch.step import Step
from mesh3d.domain.dispatch.view_semantics import VIEW_FUNCTIONS, one_process
from mesh3d.domain.dispatch.writes import record_views
from mesh3d.domain.halo.windows import WindowProbe

__all__ = ["KEPT", "KeptCalls"]

#: Rules whose answer on a one-rank domain is not torch's call on the shard: random draws (mesh3d's streams) and
#: attention (its dropout draws there too), by the module that holds them.
_NOT_TORCH_ON_THE_SHARD = ("random_ops", "random_fills", "attention", "mixed_attention", "multihead")
_NOT_GRIDS = (Layout.SLAB, Layout.STRIDED, Layout.REPLICATED, Layout.GRAPH)  # NOTE: graph rules read edges' values
#: The layouts a kept result may take (a strided result's rows are not its shard's dim: not checked here; a graph's
#: where its rule declares its layout from metadata, ``kept_steps.layout_rule``)
_KEPT = (Layout.SLAB, Layout.REPLICATED, Layout.GRAPH)
#: A kept signature whose calls take the dispatcher every time.
_DISPATCHER = object()
#: What a function's calls may keep: nothing; a one-rank layout, else a step; the same for a view (its one-process
#: answer kept too); the same, where the element-wise plan (``dispatch.elementwise_plan``) does not answer first
_NEVER, _SHARDS, _VIEWS, _ELEMENTWISE = 0, 1, 2, 3


class _Kept:
    """A kept step: its template, the journal entry its rule's call made (None: none), the domain, the settings it
    was kept under, and a view's one-process answer (``view_semantics.one_process``, the same for the signature)."""

    __slots__ = ("answer", "comm", "journal", "settings", "step")

    def __init__(self, step: KeptStep, journal: tuple | None, comm: DomainComm, settings: DomainSettings) -> None:
        self.step, self.journal, self.comm, self.settings = step, journal, comm, settings
        self.answer = [None, _UNASKED]  # NOTE: as a one-rank entry holds it (``KeptCalls._view_answer``)


#: A kept view's one-process answer before its first hit
_UNASKED: Any = False


class KeptCalls:
    """The kept answers of calls on wrapper tensors (module docstring), by signature.

    Usage: ``KEPT.dispatch(func, types, args, kwargs)`` in place of the dispatcher's ``dispatch``
    """

    def __init__(self, maxsize: int = 4096) -> None:
        self.maxsize = maxsize
        self._kept: dict[tuple, Any] = {}
        self._version = RuleTable.changes
        self._eligible: dict[Callable, tuple[int, int | None, bool]] = {}
        #: Calls answered from a kept answer since made (tests read it)
        self.hits = 0
        self.enabled = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Every call takes the dispatcher inside (the reference a test compares this path with).

        Usage: ``with KEPT.off(): expected = F.conv2d(xs, w)``
        """
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def forget(self) -> None:
        """Let the kept answers go with their mesh (``DistributedManager.on_shutdown``): they hold its specs."""
        self._kept.clear()

    def dispatch(self, func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on wrapper tensors: from a kept answer where one applies, else the dispatcher."""
        if not self.enabled or WindowProbe.active or is_compiling():
            # NOTE: a probe (``domain.downsampling_factor``) reads what the rules plan: every call takes them
            return dispatch(func, types, args, kwargs)
        if self._version != RuleTable.changes:  # NOTE: a rule registered or dropped: what was kept may not hold
            self._kept.clear()
            self._eligible.clear()
            self._version = RuleTable.changes
        eligible = self._eligible.get(func)
        if eligible is None:
            eligible = self._eligible[func] = _eligibility(func)
        mode, inplace_at, grids = eligible
        if mode == _NEVER or (inplace_at is not None and writes_inplace(args, kwargs, inplace_at)):
            return dispatch(func, types, args, kwargs)
        if mode == _ELEMENTWISE:  # NOTE: read from the operands' metadata, cheaper than a signature's look-up
            out = ELEMENTWISE_PLANS.run(func, args, kwargs)
            if out is not NotImplemented:
                self.hits += 1
                return out
        try:
            with disable_torch_function_subclass():  # NOTE: requires_grad of a wrapper would take the walk
                key = signature(func, args, kwargs, grids)
        except Unkept:
            return dispatch(func, types, args, kwargs)
        kept = self._kept.get(key)
        if kept is None:
            return self._first(func, types, args, kwargs, key)
        if kept is _DISPATCHER:
            return dispatch(func, types, args, kwargs)
        if type(kept) is _Kept:
            return self._from_step(func, types, args, kwargs, kept)
        answer: Any = False
        if mode == _VIEWS:
            answer = self._view_answer(func, args, kwargs, kept)
            if answer is _DISPATCHER:
                return dispatch(func, types, args, kwargs)
        out, fresh = _on_shards(func, args, kwargs, kept[0], kept[2])
        if out is NotImplemented:  # NOTE: torch's result is not what the rule's was (a data-dependent size)
            self._kept[key] = _DISPATCHER
            return dispatch(func, types, args, kwargs)
        self.hits += 1
        return out if fresh else record_views(out, func, args, kwargs, answer)

    @staticmethod
    def _view_answer(func: Callable, args: tuple, kwargs: dict, kept: Any) -> Any:
        """A kept view's one-process answer (``view_semantics.one_process``, the same for its signature: asked once),
        or ``_DISPATCHER`` where the dispatcher must answer: one process raises (then it raises on every rank), or
        a tensor was made as a copied view or has one (its calls are the rules' to check)."""
        for a in args:
            if type(a) is WrappedDomainTensor and has_copy_marks(a):
                return _DISPATCHER
        answer = kept[1]
        if answer is _UNASKED:
            answer = kept[1] = one_process(func, args, kwargs)
        return _DISPATCHER if answer is not None and answer.error is not None else answer

    def _first(self, func: Callable, types: tuple, args: tuple, kwargs: dict, key: tuple) -> Any:
        """The dispatcher's answer to a signature's first call, and what is kept of it."""
        if len(self._kept) >= self.maxsize:
            self._kept.clear()
        if _one_rank(args):
            out = dispatch(func, types, args, kwargs)
            graphs = _graph_led(args, kwargs)  # NOTE: then the graph rule answered: kept where it declares its layout
            layout = _DISPATCHER if graphs and not keeps_layout(LAYOUTS.of(Layout.GRAPH).rules.get(func), args, kwargs) \
                else _layout_of(out, graphs)
            # NOTE: [specs, view answer, whether an input wrapper requires grad] (the signature holds each one's flag)
            self._kept[key] = layout if layout is _DISPATCHER else [layout, _UNASKED, _any_requires_grad(args, kwargs)]
            return out
        STEP_TAP.args = args  # NOTE: the dispatcher hands this call's rule and step back (``executor.StepTap``)
        try:
            out = dispatch(func, types, args, kwargs)
        finally:
            taken = STEP_TAP.take()
        if not passes_one_tensor_twice(args, kwargs):  # NOTE: (x, x) keeps nothing: a later call may pass (a, b)
            self._kept[key] = _kept_step(taken, args, kwargs)
        return out

    def _from_step(self, func: Callable, types: tuple, args: tuple, kwargs: dict, kept: _Kept) -> Any:
        """The kept step bound to this call's tensors, run as the dispatcher runs a rule's step."""
        if kept.settings is not SETTINGS.value:  # NOTE: a rule may read the settings
            return dispatch(func, types, args, kwargs)
        answer: Any = False
        if func in VIEW_FUNCTIONS:
            answer = self._view_answer(func, args, kwargs, kept.answer)
            if answer is _DISPATCHER:
                return dispatch(func, types, args, kwargs)
        elif any(type(a) is WrappedDomainTensor and has_copy_marks(a) for a in args):
            return dispatch(func, types, args, kwargs)  # NOTE: a copied view's (or its base's) calls: the rules'
        parts = kept.step.bind(args, kwargs)
        out = run_kept(func, parts, kept.comm, kept.journal) if kept.comm.size > 1 else run_parts(*parts)
        self.hits += 1
        return record_views(out, func, args, kwargs, answer)


def _eligibility(func: Callable) -> tuple[int, int | None, frozenset]:
    """What ``func``'s calls may keep (``_NEVER``, ``_SHARDS``, ``_VIEWS``, ``_ELEMENTWISE``), where it takes ``inplace``
    positionally (None: it has no such argument), and the grid layouts (blocks, token grids) whose rule for it may be
    kept (a call on another takes the walk without paying for its signature)."""
    if is_operator(func) or func in GRADIENT_CALLS or func in DATA_QUERIES or is_metadata(func) or \
            is_global_size(func) or writes_into_first(func) or func in ARGUMENTS_TORCH_DROPS:
        # NOTE: torch's call on the shard would miss what torch dropped on its way to __torch_function__; the rule
        # reads it back
        return _NEVER, None, frozenset()
    mode = _VIEWS if func in VIEW_FUNCTIONS else _ELEMENTWISE if ELEMENTWISE_PLANS.applies(func) else _SHARDS
    if any(rule is not None and not _torch_on_the_shard(rule) for rule in (RULES.get(func), STRIDED_RULES.get(func))):
        return _NEVER, None, frozenset()  # NOTE: a rule of the user's own (``domain.register``) always runs
    grids = {e.layout for e in LAYOUTS if e.layout not in _NOT_GRIDS and may_plan_from_metadata(e.rules.get(func))}
    rule = LAYOUTS.of(Layout.GRAPH).rules.get(func)
    if may_keep_layout(rule) and _torch_on_the_shard(rule):
        grids.add(ONE_RANK_GRAPHS)  # NOTE: a graph's rules read its edges' values: kept on one rank only, as a layout
    return mode, inplace_position(func), frozenset(grids)


def _torch_on_the_shard(rule: Callable) -> bool:
    """Whether ``rule`` is mesh3d's own and answers, on one rank, what torch's call on the shard does (no draw)."""
    where = getattr(rule, "__module__", None) or ""
    return where.startswith("mesh3d.domain.") and where.rsplit(".", 1)[-1] not in _NOT_TORCH_ON_THE_SHARD


def _graph_led(args: tuple, kwargs: dict) -> bool:
    """Whether a graph tensor is among the arguments (then the graph rule answered the call)."""
    return any(t._spec.layout is Layout.GRAPH for t in _wrappers(args, kwargs))


def _wrappers(args: tuple, kwargs: dict) -> Iterator[WrappedDomainTensor]:
    """The wrapper tensors among a call's arguments and in lists of them, in order."""
    for a in (*args, *kwargs.values()):
        for t in a if type(a) is tuple or type(a) is list else (a,):
            if type(t) is WrappedDomainTensor:
                yield t


def _one_rank(args: tuple) -> bool:
    """Whether the call's domain tensors are of a one-rank domain (its first one's, as every other's is the same)."""
    first = next(_wrappers(args, {}), None)
    return first is None or first._spec.comm.size == 1


def _kept_step(taken: tuple | None, args: tuple, kwargs: dict) -> Any:
    """What is kept of a call whose rule's answer ``taken`` (``StepTap.take``) was: its step's template, else
    ``_DISPATCHER``."""
    if taken is None:
        return _DISPATCHER
    rule, step, journal = taken
    if type(step) is not Step or not plans_from_metadata(rule, args, kwargs) or \
            any(type(a) is WrappedDomainTensor and has_copy_marks(a) for a in args):
        return _DISPATCHER
    template = template_of(step, args, kwargs)
    if template is None:
        return _DISPATCHER
    for a in (*args, *kwargs.values()):
        for t in a if type(a) is tuple or type(a) is list else (a,):
            if isinstance(t, DomainTensor):
                return _Kept(template, journal, t._spec.comm, SETTINGS.value)
    return _DISPATCHER


def _leaves(out: Any) -> list | None:
    """The tensors of a result (one, or one tuple or list of them), else None."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    return None


def _layout_of(out: Any, graphs: bool = False) -> Any:
    """Each result tensor's spec (None: a plain tensor), as the rule laid it out; ``_DISPATCHER`` where not kept (a
    graph's spec only where ``graphs``: a graph rule's, declaring its layout from metadata)."""
    leaves = _leaves(out)
    if leaves is None:
        return _DISPATCHER
    layout = []
    for o in leaves:
        if type(o) is WrappedDomainTensor:
            spec = o._spec
            if spec.layout not in _KEPT or (spec.layout is Layout.GRAPH and not graphs):
                return _DISPATCHER
            layout.append(spec)
        elif type(o) in PLAIN:
            layout.append(None)
        else:
            return _DISPATCHER  # a storage domain tensor or another subclass: not what this path makes
    return tuple(layout)


def _on_shards(func: Callable, args: tuple, kwargs: dict, layout: tuple, aliased: bool = True) -> tuple[Any, bool]:
    """(torch's call on the shards laid out as kept, or NotImplemented; whether every result is fresh memory).
    ``aliased``: whether some wrapper argument requires grad (the others' alias is their shard)."""
    recorded = torch.is_grad_enabled()  # NOTE: without grad mode, no shard is read through its alias
    aliased = aliased and recorded
    local = [(a._differentiable_local() if aliased else a._local) if type(a) is WrappedDomainTensor else
             _shard(a, aliased) if type(a) is tuple or type(a) is list else a for a in args]
    try:
        out = func(*local, **{k: _shard(v, aliased) for k, v in kwargs.items()}) if kwargs else func(*local)
    except Exception:  # noqa: BLE001 - torch refuses what the rule answered (torch.all of floats): the rule's answer
        return NotImplemented, False
    if type(out) is torch.Tensor and len(layout) == 1:  # NOTE: the common case, one result: no list made
        spec = layout[0]
        if spec is None:
            return out, True
        if spec.dim is not None and (out.ndim <= spec.dim or out.shape[spec.dim] != spec.sizes[0]):
            return NotImplemented, False
        if out._base is not None or SHARD_OWNERS.marked(out):
            return DomainTensor._from_local(out, spec), False
        if recorded and out.requires_grad:
            return fresh_wrapper(out, spec), True
        return WrappedDomainTensor(out, spec), True  # NOTE: what ``fresh_wrapper`` makes of memory of its own
    leaves = _leaves(out)
    if leaves is None or len(leaves) != len(layout):
        return NotImplemented, False
    made, fresh = [], True
    for o, spec in zip(leaves, layout):
        if spec is not None:
            if spec.dim is not None and (o.ndim <= spec.dim or o.shape[spec.dim] != spec.sizes[0]):
                return NotImplemented, False
            if SHARD_OWNERS.fresh(o):
                o = fresh_wrapper(o, spec)  # NOTE: memory of its own: no input to hand back, no view to record
            else:
                o, fresh = DomainTensor._from_local(o, spec), False
        made.append(o)
    if isinstance(out, torch.Tensor):
        return made[0], fresh
    return type(out)(made), fresh


def _any_requires_grad(args: tuple, kwargs: dict) -> bool:
    """Whether a wrapper tensor among the arguments (or in a list of them) requires grad."""
    with disable_torch_function_subclass():  # NOTE: the flag read through the dispatcher would take the walk
        return any(t.requires_grad for t in _wrappers(args, kwargs))


def _shard(a: Any, recorded: bool) -> Any:
    kind = type(a)
    if kind is WrappedDomainTensor:
        return a._differentiable_local() if recorded else a._local
    if kind is tuple or kind is list:
        return kind(_shard(x, recorded) for x in a)
    return a


#: The kept answers of this process (``mesh3d.domain`` installs ``KEPT.dispatch`` for wrapper tensors)
KEPT = KeptCalls()
