"""Calls on wrapper tensors of a one-rank domain: torch's own op on the shard, in the layout its rule gave.

Where one domain rank holds the whole tensor (``domain=1``, the size most models start and debug at), the shard *is*
the whole tensor, so a ruled function's answer is torch's on the shard: what the rule adds is only the layout of the
results (which are domain tensors, with what spec). The first call of a signature takes the dispatcher, and the
layout of its results is kept; a later call of that signature calls the function on the shards (autograd records it
on their differentiable aliases, as a rule's step is recorded) and lays the results out the same way, without the
dispatcher's walk (about 15-25 us of a wrapper op's host cost on CPU, issue 64).

A signature is the function, the rule tables' version (a rule registered or dropped since starts afresh), grad mode,
and every argument: a wrapper tensor's spec, shard shape, dtype and ``requires_grad``; a plain tensor's type, shape,
dtype, device and ``requires_grad``; any other value as itself (ints, floats, strings, dtypes, None, tuples of them).
An argument of any other kind (a storage domain tensor, a DTensor, a list of lists, an object) takes the dispatcher.

Never kept (each takes the dispatcher every time): a multi-rank domain, blocks, token grids and graphs; a write
(``add_``, ``out=``, ``inplace=True``); a view (``dispatch.writes`` records how views are made); metadata, sizes and
gradient calls (answered before); random draws and attention (a rule there draws from mesh3d's streams); calls
while a ``WindowProbe`` reads what the rules plan (``domain.downsampling_factor``); a result
other than tensors or one tuple of them; a result whose length along its sharded dim is not its spec's (a
data-dependent size, as ``nonzero``'s). While torch.compile traces, the dispatcher runs the rules.

Usage (``mesh3d.domain`` installs it for wrapper tensors)::

    WrappedDomainTensor._dispatcher = staticmethod(ONE_RANK.dispatch)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mesh3d._torch_private import ARGUMENTS_TORCH_DROPS, disable_torch_function_subclass, is_operator
from mesh3d.domain.core.specs import DomainSpec, Layout
from mesh3d.domain.core.shard_owners import SHARD_OWNERS
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.wrapped import WrappedDomainTensor, fresh_wrapper
from mesh3d.domain.dispatch.dispatcher import dispatch
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.queries import DATA_QUERIES, is_global_size, is_metadata
from mesh3d.domain.dispatch.registry import (
    RULES, STRIDED_RULES, RuleTable, inplace_position, writes_inplace, writes_into_first)
from mesh3d.domain.dispatch.view_semantics import VIEW_FUNCTIONS
from mesh3d.domain.dispatch.writes import record_views
from mesh3d.domain.halo.windows import WindowProbe

__all__ = ["ONE_RANK", "OneRankCalls"]

#: Rules whose answer on a one-rank domain is not torch's call on the shard: random draws (mesh3d's streams) and
#: attention (its dropout draws there too), by the module that holds them.
_NOT_TORCH_ON_THE_SHARD = ("random_ops", "random_fills", "attention", "mixed_attention", "multihead")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_SLABS = (Layout.SLAB, Layout.STRIDED, Layout.REPLICATED)
#: The layouts a kept result may take (a strided result's rows are not its shard's dim: not checked here)
_KEPT = (Layout.SLAB, Layout.REPLICATED)
#: A kept signature whose calls take the dispatcher every time.
_DISPATCHER = object()


class _Unkept(Exception):
    """An argument or result outside what a kept layout covers."""


class OneRankCalls:
    """The kept layouts of calls on wrapper tensors of a one-rank domain (module docstring), by signature.

    Usage: ``ONE_RANK.dispatch(func, types, args, kwargs)`` in place of the dispatcher's ``dispatch``
    """

    def __init__(self, maxsize: int = 4096) -> None:
        self.maxsize = maxsize
        self._layouts: dict[tuple, Any] = {}
        self._version = RuleTable.changes
        self._eligible: dict[Callable, int | None | bool] = {}
        #: Calls answered on the shards since made (tests read it)
        self.hits = 0
        self.enabled = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Every call takes the dispatcher inside (the reference a test compares this path with).

        Usage: ``with ONE_RANK.off(): expected = F.conv2d(xs, w)``
        """
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def forget(self) -> None:
        """Let the kept layouts go with their mesh (``DistributedManager.on_shutdown``): they hold its specs."""
        self._layouts.clear()

    def dispatch(self, func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on wrapper tensors: from a kept layout where one applies, else the dispatcher."""
        if not self.enabled or WindowProbe.active or torch.compiler.is_compiling():
            # NOTE: a probe (``domain.downsampling_factor``) reads what the rules plan: every call takes them
            return dispatch(func, types, args, kwargs)
        if self._version != RuleTable.changes:  # NOTE: a rule registered or dropped: what was kept may not hold
            self._layouts.clear()
            self._eligible.clear()
            self._version = RuleTable.changes
        inplace_at = self._eligible.get(func, True)
        if inplace_at is True:
            inplace_at = self._eligible[func] = _eligibility(func)
        if inplace_at is False or (inplace_at is not None and writes_inplace(args, kwargs, inplace_at)):
            return dispatch(func, types, args, kwargs)
        try:
            with disable_torch_function_subclass():  # NOTE: requires_grad of a wrapper would take the walk
                key = (func, torch.is_grad_enabled(), _signature(args), _signature(kwargs) if kwargs else None)
        except _Unkept:
            return dispatch(func, types, args, kwargs)
        layout = self._layouts.get(key)
        if layout is None:
            out = dispatch(func, types, args, kwargs)
            if len(self._layouts) >= self.maxsize:
                self._layouts.clear()
            self._layouts[key] = _layout_of(out)
            return out
        if layout is _DISPATCHER:
            return dispatch(func, types, args, kwargs)
        out, fresh = _on_shards(func, args, kwargs, layout)
        if out is NotImplemented:  # NOTE: torch's result is not what the rule's was (a data-dependent size)
            self._layouts[key] = _DISPATCHER
            return dispatch(func, types, args, kwargs)
        self.hits += 1
        return out if fresh else record_views(out, func, args, kwargs)


def _eligibility(func: Callable) -> int | None | bool:
    """False: never kept; else where ``func`` takes ``inplace`` positionally (None: it has no such argument)."""
    if is_operator(func) or func in GRADIENT_CALLS or func in VIEW_FUNCTIONS or func in DATA_QUERIES or \
            is_metadata(func) or is_global_size(func) or writes_into_first(func) or func in ARGUMENTS_TORCH_DROPS:
        # NOTE: torch's call on the shard would miss what torch dropped on its way to __torch_function__; the rule
        # reads it back
        return False
    for table in (RULES, STRIDED_RULES):
        rule = table.get(func)
        where = getattr(rule, "__module__", None) or ""
        if rule is not None and (not where.startswith("mesh3d.domain.") or where.rsplit(".", 1)[-1] in _NOT_TORCH_ON_THE_SHARD):
            return False  # NOTE: a rule of the user's own (``domain.register``) always runs
    return inplace_position(func)


def _signature(values: Any) -> tuple:
    if isinstance(values, dict):
        if "out" in values:
            raise _Unkept
        return tuple((k, _part(v)) for k, v in values.items())
    return tuple(_part(v) for v in values)


def _part(v: Any) -> Any:
    kind = type(v)
    if kind is WrappedDomainTensor:
        spec = v._spec
        if type(spec) is not DomainSpec or spec.layout not in _SLABS or spec.comm.size != 1:
            raise _Unkept
        return (spec, v._local.shape, v._local.dtype, v.requires_grad)
    if kind in _PLAIN:
        return (kind, v.shape, v.dtype, v.device, v.requires_grad)
    if kind in _VALUES:
        return (kind, v)  # NOTE: the type too: 1, 1.0 and True are one key otherwise
    if kind is tuple or kind is list:
        return (kind, tuple(_part(x) for x in v))
    raise _Unkept


def _leaves(out: Any) -> list | None:
    """The tensors of a result (one, or one tuple or list of them), else None."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    return None


def _layout_of(out: Any) -> Any:
    """Each result tensor's spec (None: a plain tensor), as the rule laid it out; ``_DISPATCHER`` where not kept."""
    leaves = _leaves(out)
    if leaves is None:
        return _DISPATCHER
    layout = []
    for o in leaves:
        if type(o) is WrappedDomainTensor:
            spec = o._spec
            if type(spec) is not DomainSpec or spec.layout not in _KEPT:
                return _DISPATCHER
            layout.append(spec)
        elif type(o) in _PLAIN:
            layout.append(None)
        else:
            return _DISPATCHER  # a storage domain tensor or another subclass: not what this path makes
    return tuple(layout)


def _on_shards(func: Callable, args: tuple, kwargs: dict, layout: tuple) -> tuple[Any, bool]:
    """(torch's call on the shards laid out as kept, or NotImplemented; whether every result is fresh memory)."""
    local = [_shard(a) for a in args]
    try:
        out = func(*local, **{k: _shard(v) for k, v in kwargs.items()}) if kwargs else func(*local)
    except Exception:  # noqa: BLE001 - torch refuses what the rule answered (torch.all of floats): the rule's answer
        return NotImplemented, False
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


def _shard(a: Any) -> Any:
    kind = type(a)
    if kind is WrappedDomainTensor:
        return a._differentiable_local()
    if kind is tuple or kind is list:
        return kind(_shard(x) for x in a)
    return a


#: The kept layouts of this process (``mesh3d.domain`` installs ``ONE_RANK.dispatch`` for wrapper tensors)
ONE_RANK = OneRankCalls()
