"""A rule's step kept as a template of its call's arguments, so a later call of the same signature skips the rule.

A rule reads its tensors' metadata (specs, shapes, dtypes) and the call's other arguments, and returns a ``Step``: a
local function, the inputs it needs (the call's tensors, or requirements on them: halo rows, a row map, a layout, a
replicated value entering) and the result's layout. Where the step holds the call's own tensors only where they were
passed, and everything else in it is plain data (ints, specs, plans, functions closing over such data), it is the
same step for every call of that signature, but for the tensors: ``template_of`` keeps it with each tensor replaced by
where it was passed, and ``KeptStep.bind`` puts a later call's tensors there. A step holding any other tensor (one the
rule made, a slice of a plain tensor, a weight its function closes over) or any object this module cannot read as
data is not kept: its rule runs on every call.

NOTE: a rule that reads its tensors' *values* to plan (an index tensor's rows) would be kept with those values baked
in, which a signature does not cover: only the rules of ``METADATA_RULE_MODULES`` (which plan from metadata alone) are
kept. Random draws and attention are not among them (their steps draw from mesh3d's streams).

Usage (``dispatch.kept`` keeps a multi-rank call's step and binds it on the next call)::

    kept = template_of(step, args, kwargs)        # None: not kept
    parts = kept.bind(args, kwargs)                # the rule's step for this call's tensors (run_parts' arguments)
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mesh3d._torch_private import OpOverload, OpOverloadPacket
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import LayoutSpec
from mesh3d.domain.dispatch.step import Step

__all__ = ["KeptStep", "METADATA_RULE_MODULES", "keeps_layout", "layout_rule", "may_keep_layout", "may_plan_from_metadata",
           "metadata_rule", "passes_one_tensor_twice", "plans_from_metadata", "template_of"]

#: The rule modules whose rules plan from their tensors' metadata and the call's other arguments alone.
METADATA_RULE_MODULES = frozenset({
    "mesh3d.domain.ops.pointwise", "mesh3d.domain.ops.reshape", "mesh3d.domain.ops.conv", "mesh3d.domain.ops.pool",
    "mesh3d.domain.ops.norm", "mesh3d.domain.ops.reduce", "mesh3d.domain.ops.unfold", "mesh3d.domain.ops.einsum",
    "mesh3d.domain.ops.interpolate", "mesh3d.domain.ops.order", "mesh3d.domain.ops.spectral",
    "mesh3d.domain.ops.vector_norms", "mesh3d.domain.ops.finite_differences", "mesh3d.domain.ops.blocks.rules",
    "mesh3d.domain.ops.blocks.resample", "mesh3d.domain.ops.blocks.norms", "mesh3d.domain.ops.blocks.spectral",
    "mesh3d.domain.ops.tokens.rules"})

_DATA = (int, float, bool, complex, str, bytes, type(None), type(Ellipsis), slice, range, torch.dtype, torch.device,
         torch.memory_format, torch.layout, torch.Size, LayoutSpec, DomainComm)
#: Functions whose behaviour no captured value changes (torch's own builtins, methods of its tensor type).
_OPAQUE_FUNCTIONS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                     types.MethodWrapperType, types.ClassMethodDescriptorType, types.GetSetDescriptorType)
_DEPTH = 12


class _At(NamedTuple):
    """Where a call's tensor was passed: a position (or keyword name), and its place in a list there (or -1)."""

    key: int | str
    index: int


class _Requirement(NamedTuple):
    """A requirement dataclass on a call's tensors: its class and its fields, each a template."""

    kind: type
    fields: tuple[tuple[str, Any], ...]


class _Seq(NamedTuple):
    kind: type
    items: tuple


#: The templates a bound step fills with the call's tensors
_BOUND = (_At, _Seq, _Requirement)


class _Unkeepable(Exception):
    """A step holding something this module cannot read as data: its rule runs on every call."""


def may_plan_from_metadata(rule: Callable | None) -> bool:
    """Whether some call of ``rule`` may plan from metadata alone (``plans_from_metadata`` says which)."""
    return rule is not None and (getattr(rule, "__module__", None) in METADATA_RULE_MODULES or hasattr(rule, _MARK))


def plans_from_metadata(rule: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``rule`` planned this call from metadata alone: its module's rules all do (``METADATA_RULE_MODULES``),
    or it was declared so (``metadata_rule``) for calls like this one."""
    if getattr(rule, "__module__", None) in METADATA_RULE_MODULES:
        return True
    when = getattr(rule, _MARK, None)
    return when is not None and (when is True or when(*args, **kwargs))


_MARK = "__mesh3d_plans_from_metadata__"


def metadata_rule(when: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """Declare a rule of a module that also holds value-reading rules as planning from metadata alone (for the calls
    ``when`` accepts, if given: ``x[1:]`` plans from metadata, ``x[index]`` reads the index's values).

    Usage: ``@register(torch.unsqueeze)`` over ``@metadata_rule()`` over ``def _unsqueeze(input, dim): ...``
    """
    def mark(rule: Callable) -> Callable:
        setattr(rule, _MARK, True if when is None else when)
        return rule
    return mark


def layout_rule(when: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """Declare a rule whose results' layout follows from its call's metadata alone, though its answer may read values
    (a graph gather maps node ids to rows): on a one-rank domain, where the rank's items are all the items in their
    global order, its answer is torch's on the shards, and ``dispatch.kept`` keeps that layout (for the calls ``when``
    accepts, if given: not a mask, whose kept items follow from its values).

    Usage: ``GRAPH_RULES.register(torch.index_select, layout_rule()(_index_select))``
    """
    def mark(rule: Callable) -> Callable:
        setattr(rule, _LAYOUT_MARK, True if when is None else when)
        return rule
    return mark


def may_keep_layout(rule: Callable | None) -> bool:
    """Whether some one-rank call of ``rule`` may keep its layout (``keeps_layout`` says which)."""
    return may_plan_from_metadata(rule) or hasattr(rule, _LAYOUT_MARK)


def keeps_layout(rule: Callable | None, args: tuple, kwargs: dict) -> bool:
    """Whether the layout ``rule`` gave this call follows from its metadata alone (``layout_rule``): a rule planning
    from metadata, or one declared so for calls like this one."""
    if rule is None:
        return False
    when = getattr(rule, _LAYOUT_MARK, None)
    return plans_from_metadata(rule, args, kwargs) or (when is not None and (when is True or when(*args, **kwargs)))


_LAYOUT_MARK = "__mesh3d_layout_from_metadata__"


class KeptStep(NamedTuple):
    """A step with the call's tensors replaced by where they were passed (``template_of``): its arguments as kept, and
    the places among them that take the call's tensors (with what to put there)."""

    compute: Callable
    args: tuple
    slots: tuple[tuple[int, Any], ...]
    kwargs: tuple[tuple[str, Any], ...]
    out: Any
    out_ndim: int | None
    keep: tuple
    partial: Any = None
    laid_out_as: Any = None

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """The step for a call of the signature this one was kept from, with that call's tensors, as the arguments of
        ``executor.run_parts``: ``(compute, args, kwargs, out, out_ndim, keep, partial, laid_out_as)``."""
        bound = list(self.args)
        for i, template in self.slots:
            bound[i] = _bound(template, args, kwargs)
        return (self.compute, bound, {k: _bound(v, args, kwargs) for k, v in self.kwargs} if self.kwargs else {},
                self.out, self.out_ndim, tuple([_bound(t, args, kwargs) for t in self.keep]) if self.keep else (),
                self.partial, self.laid_out_as)


def template_of(step: Step, args: tuple, kwargs: dict) -> KeptStep | None:
    """``step`` (a rule's answer to ``func(*args, **kwargs)``) as a template of the call's tensors, or None where it
    holds anything else (module docstring), or where the call passed one tensor in two places."""
    places: dict[int, _At] = {}
    for key, value in (*enumerate(args), *kwargs.items()):
        for i, t in enumerate(value) if type(value) in (list, tuple) else ((-1, value),):
            if isinstance(t, torch.Tensor):
                if id(t) in places:  # NOTE: (x, x): which place the step's x came from is unknown (a later call
                    return None  # passing (a, b) would get one of them twice): ``passes_one_tensor_twice``
                places[id(t)] = _At(key, i)
    try:
        _check_function(step.compute, _DEPTH)
        templates = tuple(_template(a, places, _DEPTH) for a in step.args)
        slots = tuple((i, t) for i, t in enumerate(templates) if type(t) in _BOUND)
        return KeptStep(step.compute, templates, slots,
                        tuple((k, _template(v, places, _DEPTH)) for k, v in step.kwargs.items()),
                        _data(step.out, _DEPTH), step.out_ndim, tuple(_template(t, places, _DEPTH) for t in step.keep),
                        _data(step.partial, _DEPTH), _data(step.laid_out_as, _DEPTH))
    except _Unkeepable:
        return None


def passes_one_tensor_twice(args: tuple, kwargs: dict) -> bool:
    """Whether one tensor is passed in two places of a call (``x * x``, ``torch.cat([x, x])``): nothing of such a
    call is kept, so the next call of its signature keeps its own step."""
    seen: set[int] = set()
    for a in (*args, *kwargs.values()):
        for t in a if type(a) is tuple or type(a) is list else (a,):
            if isinstance(t, torch.Tensor):
                if id(t) in seen:
                    return True
                seen.add(id(t))
    return False


def _template(value: Any, places: dict[int, _At], depth: int) -> Any:
    if depth < 0:
        raise _Unkeepable
    if isinstance(value, torch.Tensor):
        at = places.get(id(value))
        if at is None:
            raise _Unkeepable  # NOTE: a tensor the rule made or sliced: it holds this call's values
        return at
    kind = type(value)
    if kind is tuple or kind is list:
        items = tuple(_template(v, places, depth - 1) for v in value)
        return _Seq(kind, items) if any(type(t) in _BOUND for t in items) else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and any(
            isinstance(getattr(value, f.name), torch.Tensor) for f in dataclasses.fields(value)):
        return _Requirement(kind, tuple((f.name, _template(getattr(value, f.name), places, depth - 1))
                                        for f in dataclasses.fields(value)))
    return _data(value, depth)


def _data(value: Any, depth: int) -> Any:
    """``value`` itself where it is plain data (no tensor, nothing a later call could change), else ``_Unkeepable``."""
    if depth < 0:
        raise _Unkeepable
    if isinstance(value, _DATA) or isinstance(value, type):
        return value
    kind = type(value)
    if isinstance(value, (tuple, list, frozenset)):  # NOTE: named tuples too (a plan's spans)
        for v in value:
            _data(v, depth - 1)
        return value
    if kind is dict:
        for v in value.values():
            _data(v, depth - 1)
        return value
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        for f in dataclasses.fields(value):
            _data(getattr(value, f.name), depth - 1)
        return value
    if callable(value):
        _check_function(value, depth - 1)
        return value
    raise _Unkeepable


def _check_function(fn: Any, depth: int) -> None:
    """Raise ``_Unkeepable`` unless every value ``fn`` closes over (cells, defaults, a partial's arguments) is data."""
    if depth < 0:
        raise _Unkeepable
    if isinstance(fn, (*_OPAQUE_FUNCTIONS, OpOverload, OpOverloadPacket)):
        return
    if isinstance(fn, functools.partial):
        _check_function(fn.func, depth - 1)
        for v in (*fn.args, *fn.keywords.values()):
            _data(v, depth - 1)
        return
    if isinstance(fn, types.MethodType):
        _data(fn.__self__, depth - 1)
        _check_function(fn.__func__, depth - 1)
        return
    if isinstance(fn, types.FunctionType):
        for cell in fn.__closure__ or ():
            try:
                _data(cell.cell_contents, depth - 1)
            except ValueError:  # an empty cell (a name bound later): nothing captured yet
                raise _Unkeepable from None
        for v in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            _data(v, depth - 1)
        return
    raise _Unkeepable  # NOTE: an object with __call__ (a module, a Function instance): it may hold anything


def _bound(template: Any, args: tuple, kwargs: dict) -> Any:
    kind = type(template)
    if kind is _At:
        value = args[template.key] if type(template.key) is int else kwargs[template.key]
        return value if template.index < 0 else value[template.index]
    if kind is _Seq:
        return template.kind(_bound(v, args, kwargs) for v in template.items)
    if kind is _Requirement:
        return template.kind(**{name: _bound(v, args, kwargs) for name, v in template.fields})
    return template
