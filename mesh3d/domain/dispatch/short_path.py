"""The short path: calls on domain tensors answered before the dispatcher's walk, where that walk would only add time.

``DomainTensor.__torch_function__`` looks the called function up in ``SHORT`` first; a handler returns the answer, or
``NotImplemented`` where its case does not hold (then the dispatcher runs, as for every other call):

* metadata queries (``.dtype``, ``.device``, ``dim()`` ...): answered from the shard, as the dispatcher does (not
  ``.grad``, which the dispatcher lays out as the whole tensor: ``dispatch.grads``);
* size queries (``.shape``, ``size()``, ``numel()`` ...): the whole tensor's answer, as the dispatcher gives it;
* element-wise ops whose tensor operands are all domain tensors of one slab layout (the same spec, the same number of
  dims): the op on the shards, the result taking that spec. Anything else (a plain tensor operand to broadcast or
  slice, other layouts or sizes to move, a replicated value entering, a result of global length 1) takes the
  dispatcher's element-wise rule;
* views of a slab (``view``, ``reshape``, ``transpose``, ``unsqueeze`` ...): their rules read nothing but the spec,
  the shard's shape and the arguments, so each runs once per such signature (``ViewSteps``) and its local call and
  result spec serve every later call; a rule whose step moves rows (a reshape into whole windows) is not kept. On a
  multi-rank domain a view that changes the layout is journaled, as the dispatcher journals it.

Wrapper tensors (issue 64's switch) have a table of their own, ``WRAPPED_SHORT``: metadata, sizes, and element-wise
ops of one slab layout and one shard shape, run on the shards (behind the result's one autograd edge where a gradient
is wanted, ``core.wrapped.fresh_wrapper``).

Each is exactly what the dispatcher's own branch does for such a call, without its walk: on tiny tensors the walk
was most of the 15-25 us a domain op cost on the CPU (scripts/bench_domain.py, docs/benchmarks.md). While Dynamo
traces, every call takes the dispatcher (the short path switches a result's class, which Dynamo cannot trace).

Usage (``mesh3d.domain`` installs it; the element-wise rules give their functions the short path)::

    DomainTensor._short = SHORT
    short_elementwise(torch.relu)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import disable_torch_function_subclass as _Disabled
from mesh3d.domain.comm.divergence import JOURNAL
from mesh3d.domain.core.copied_views import has_copy_marks
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.shard_owners import SHARD_OWNERS
from mesh3d.domain.core.tensor import DomainTensor, wrap
from mesh3d.domain.core.wrapped import WrappedDomainTensor, fresh_wrapper
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.queries import GLOBAL_SIZES, METADATA, global_size_answer
from mesh3d.domain.dispatch.registry import RULES, inplace_position, op_name, writes_inplace, writes_into_first
from mesh3d.domain.dispatch.step import Step
from mesh3d.domain.dispatch.view_semantics import VIEW_FUNCTIONS, one_process
from mesh3d.domain.dispatch.writes import fresh_layout, record_views

__all__ = ["SHORT", "VIEW_STEPS", "WRAPPED_SHORT", "ViewSteps", "forget_last_spec", "journal_layout_change", "reclassed",
           "rule_unchanged", "short_elementwise", "short_view", "take_short_path"]

_Tensor = torch.Tensor


#: Function -> its short handler (``DomainTensor._short``).
SHORT: dict[Callable, Callable[[Callable, tuple, dict | None], Any]] = {}
#: The same for wrapper tensors (``WrappedDomainTensor._short``): metadata, sizes and element-wise ops.
WRAPPED_SHORT: dict[Callable, Callable[[Callable, tuple, dict | None], Any]] = {}


def _metadata(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    with _Disabled():
        return func(*args, **(kwargs or {}))


def _global_size(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    if not args or type(args[0]) is not DomainTensor or torch.compiler.is_compiling():
        return NotImplemented  # NOTE: torch.compile fakifying an input asks for the shard's sizes: the dispatcher's
    return global_size_answer(func, args[0], args[1:], kwargs or {})


def _slab(spec: Any) -> bool:
    """A sharded slab whose element-wise results keep it (global length not 1: such results become replicated)."""
    return type(spec) is DomainSpec and spec.dim is not None and spec.outer == 1 and sum(spec.sizes) != 1


class _LastSpec:
    """The last spec found to be a slab: element-wise chains keep one spec object, so one identity check serves."""

    spec: Any = None

    @classmethod
    def forget(cls) -> None:
        """Let the spec go with its mesh (``DistributedManager.on_shutdown``)."""
        cls.spec = None


forget_last_spec = _LastSpec.forget


def take_short_path(func: Callable, handler: Callable[[Callable, tuple, dict | None], Any]) -> None:
    """Answer ``func`` (ruled for slabs already) with ``handler`` first, while its slab rule is the one it has now: a
    rule registered over it later (``override=True``) takes every call again (``rule_unchanged``).

    Usage: ``take_short_path(F.conv2d, short_conv)``
    """
    if RULES.get(func) is None:  # NOTE: a call without a rule must reach the dispatcher, which refuses it by name
        raise ValueError(f"{op_name(func)} has no slab rule: the short path only answers calls the dispatcher rules")
    _RULED[func] = RULES.get(func)
    SHORT[func] = handler


def reclassed(fresh: Any, spec: Any) -> DomainTensor:
    """``fresh`` (a plain tensor an op just made) as a DomainTensor itself, as ``adopt`` does for fresh results: the
    op's own autograd node stays the result's.

    Usage: ``return reclassed(torch.relu(local), spec)``
    """
    fresh.__class__ = DomainTensor
    fresh._spec = spec
    return fresh


def rule_unchanged(func: Callable) -> bool:
    """Whether ``func``'s slab rule is the one it had when it took the short path."""
    return RULES.get(func) is _RULED[func]


def journal_layout_change(func: Callable, out: DomainSpec) -> None:
    """Journal a layout-changing call on a multi-rank domain as the dispatcher does (``JOURNAL``: every rank must
    journal alike, whichever path its call took).

    Usage: ``if spec.comm.size > 1: journal_layout_change(F.conv2d, out_spec)``
    """
    label = _LABELS.get(func)
    if label is None:
        label = _LABELS[func] = op_name(func)
    JOURNAL.record(label, (out.dim, sum(out.sizes)))


_RULED: dict[Callable, Any] = {}
_LABELS: dict[Callable, str] = {}


def short_elementwise(func: Callable) -> None:
    """Give ``func`` (an element-wise function, ruled already) the short path.

    Usage: ``short_elementwise(torch.relu)``
    """
    take_short_path(func, _elementwise_writing if writes_into_first(func) else _elementwise)
    if not writes_into_first(func):  # NOTE: a write into a wrapper tensor takes the dispatcher (``dispatch.writes``)
        WRAPPED_SHORT[func] = _elementwise_wrapped
        _INPLACE_AT[func] = inplace_position(func)


#: Element-wise function -> the position of its ``inplace`` parameter (``F.relu(x, inplace=True)``), or None.
_INPLACE_AT: dict[Callable, int | None] = {}


def _writes_in_place(func: Callable, args: tuple, kwargs: dict | None) -> bool:
    at = _INPLACE_AT.get(func)
    return at is not None and writes_inplace(args, kwargs, at)


def _elementwise_wrapped(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """An element-wise op on wrapper tensors of one slab layout and one shard shape: torch's op on the shards, the
    result laid out as its operands."""
    if RULES.get(func) is not _RULED[func] or torch.compiler.is_compiling() or _writes_in_place(func, args, kwargs):
        # NOTE: AOTAutograd's trace runs the rules on fake shards (``core.wrapped``); a write (F.relu(x, inplace=True))
        # takes the dispatcher, which rebases the tensor written
        return NotImplemented
    like = None
    recorded = False  # whether autograd records the call (a wrapper argument requires grad, grad mode on)
    grad_on = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, _Tensor):
            if type(a) is not WrappedDomainTensor:
                return NotImplemented
            if like is None:
                like = a
            elif (a._spec is not like._spec and a._spec != like._spec) or a._local.shape != like._local.shape:
                return NotImplemented
            if grad_on and not recorded:
                with _Disabled():  # NOTE: a wrapper's flag read through the dispatcher costs a whole walk
                    recorded = a.requires_grad
    if like is None:
        return NotImplemented
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, _Tensor):
                return NotImplemented
    spec = like._spec
    if spec is not _LastSpec.spec:
        if not _slab(spec):
            return NotImplemented
        _LastSpec.spec = spec
    # NOTE: torch's op on the shards: recorded (a gradient wanted), on their differentiable aliases behind the result's
    # one edge, as a rule's step is (``fresh_wrapper``), so its backward runs on plain shards; else without any edge.
    # Recorded on the wrappers instead, below autograd, each op cost a round trip through the floor forward and one per
    # backward formula (12-15 us each on the CPU), and a boundary edge to every rule-answered op next to it
    try:
        if recorded:
            out = func(*[a._differentiable_local() if type(a) is WrappedDomainTensor else a for a in args],
                       **(kwargs or {}))
        else:
            out = func(*[a._local if type(a) is WrappedDomainTensor else a for a in args], **(kwargs or {}))
    except Exception:  # noqa: BLE001 - NOTE: the dispatcher runs it again, raising the error and telling the peers
        return NotImplemented
    if type(out) is not _Tensor or out.shape != like._local.shape or not SHARD_OWNERS.fresh(out):
        return NotImplemented  # NOTE: not a fresh result (``x.float()`` of a float x is x): the dispatcher's
    if not recorded:
        made = WrappedDomainTensor(out, spec, like=like)
        if made._strides is like._strides:  # NOTE: laid out as its operand (the one-process layout of an element-wise
            return made  # result of a dense one): nothing left open
    else:
        made = fresh_wrapper(out, spec)
    return made if made._local.shape == made._whole else fresh_layout(made, func, args, kwargs)


def _global_size_wrapped(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    if not args or type(args[0]) is not WrappedDomainTensor or torch.compiler.is_compiling():
        return NotImplemented
    return global_size_answer(func, args[0], args[1:], kwargs or {})


def _elementwise_writing(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """An in-place element-wise op: the dispatcher's unless its target is a copied view or has one (it refuses)."""
    if args and type(args[0]) is DomainTensor and has_copy_marks(args[0]):
        return NotImplemented
    return _elementwise(func, args, kwargs)


def _elementwise(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """An element-wise op on domain tensors of one slab layout, answered on the shards (module docstring)."""
    if RULES.get(func) is not _RULED[func]:
        return NotImplemented
    spec = None
    for a in args:
        if isinstance(a, _Tensor):
            if type(a) is not DomainTensor:
                return NotImplemented
            if spec is None:
                spec = a._spec
            elif a._spec is not spec and a._spec != spec:
                return NotImplemented
    if spec is None:
        return NotImplemented
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, _Tensor):
                return NotImplemented
    if spec is not _LastSpec.spec:
        if not _slab(spec):
            return NotImplemented
        _LastSpec.spec = spec
    with _Disabled():
        ndim = -1
        shards = []
        for a in args:
            if isinstance(a, _Tensor):
                if ndim < 0:
                    ndim = a.ndim
                elif a.ndim != ndim:
                    return NotImplemented  # another alignment of the sharded dim: the rule checks it
                a = a.as_subclass(_Tensor)  # NOTE: as ``unwrap``: autograd saves the shard's alias, never a domain tensor
            shards.append(a)
        try:
            out = func(*shards, **(kwargs or {}))
        except Exception:  # noqa: BLE001 - NOTE: the dispatcher runs it again, raising the error and telling the peers
            return NotImplemented
        if type(out) is not _Tensor:
            return out  # not a tensor
        if out.ndim != ndim:
            return out
        if out.is_leaf and out.requires_grad:
            return wrap(out, spec)  # as ``adopt``: a caller may hold such a tensor
    return reclassed(out, spec)


class ViewSteps:
    """The local call and result spec of each view of a slab, by (function, spec, shard shape, arguments); ``False``
    for a signature whose step is not a view of its input alone. At most ``maxsize`` kept (then it starts over)."""

    def __init__(self, maxsize: int = 4096) -> None:
        self.maxsize = maxsize
        self.steps: dict[tuple, Any] = {}

    def find(self, func: Callable, rule: Callable, args: tuple, kwargs: dict | None, key: tuple) -> Any:
        """The kept ``(spec, compute, constant arguments, result spec, result ndim, layout changes)`` of ``key`` (whose
        second item is the spec's id: the kept spec keeps the id taken), made from the rule's step on a miss (None:
        the rule refused; the dispatcher runs it again and raises, telling the peers). Raises TypeError for a key
        that does not hash (a list among the arguments)."""
        hit = self.steps.get(key)
        if hit is not None and (hit is False or hit[0] is args[0]._spec):
            return hit
        try:
            step = rule(*args, **(kwargs or {}))
        except Exception:  # noqa: BLE001 - the dispatcher runs the rule again, and its error reaches the caller
            return None
        x = args[0]
        out = getattr(step, "out", None)
        keep = type(step) is Step and step.args and step.args[0] is x and type(out) is DomainSpec and \
            out.dim is not None and sum(out.sizes) != 1 and not any(isinstance(a, _Tensor) for a in step.args[1:]) \
            and not any(isinstance(v, _Tensor) for v in step.kwargs.values())
        hit = (x._spec, step.compute, step.args[1:], step.kwargs, out, step.out_ndim,
               out is not x._spec and out != x._spec) if keep else False
        if len(self.steps) >= self.maxsize:
            self.steps.clear()
        self.steps[key] = hit
        return hit


#: The views' steps of this process.
VIEW_STEPS = ViewSteps()


def short_view(func: Callable) -> None:
    """Give ``func`` (a view ruled for slabs already) the short path while its rule is the one it has now.

    Usage: ``short_view(torch.Tensor.transpose)``
    """
    take_short_path(func, _view)
    WRAPPED_SHORT[func] = _view_wrapped


def _view(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """A view of a slab from its kept step (``ViewSteps``; module docstring)."""
    x = args[0] if args else None
    if type(x) is not DomainTensor:
        return NotImplemented
    spec = x._spec
    rule = RULES.get(func)
    if rule is not _RULED[func] or type(spec) is not DomainSpec or spec.dim is None or spec.outer != 1:
        return NotImplemented
    for a in args[1:]:
        if isinstance(a, _Tensor):  # NOTE: a tensor is no key (it hashes by id, and ids are reused)
            return NotImplemented
    with _Disabled():
        shape = x.shape
    try:
        hit = VIEW_STEPS.find(func, rule, args, kwargs,
                              (func, id(spec), shape, args[1:], tuple(kwargs.items()) if kwargs else ()))
    except TypeError:  # a list among the arguments
        return NotImplemented
    if not hit:
        return NotImplemented
    _, compute, extra, extra_kwargs, out_spec, out_ndim, changes_layout = hit
    with _Disabled():
        try:
            out = compute(x.as_subclass(_Tensor), *extra, **extra_kwargs)  # NOTE: the shard's alias, as ``unwrap``
        except Exception:  # noqa: BLE001 - e.g. view() of a non-contiguous shard: the dispatcher raises it everywhere
            return NotImplemented
        if type(out) is not _Tensor or (out_ndim is not None and out.ndim != out_ndim):
            return out
    if changes_layout and spec.comm.size > 1:
        journal_layout_change(func, out_spec)
    return reclassed(out, out_spec)


def _view_wrapped(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """A view of a wrapper tensor's slab from its kept step (``ViewSteps``, as ``_view``): the compute on the shard's
    differentiable alias, the result a wrapper tensor whose views are recorded as the dispatcher records them."""
    x = args[0] if args else None
    if type(x) is not WrappedDomainTensor or torch.compiler.is_compiling():
        return NotImplemented
    spec = x._spec
    rule = RULES.get(func)
    if rule is not _RULED[func] or type(spec) is not DomainSpec or spec.dim is None or spec.outer != 1 or \
            has_copy_marks(x):
        return NotImplemented
    for a in args[1:]:
        if isinstance(a, _Tensor):
            return NotImplemented
    shape = x._local.shape
    rest = tuple(kwargs.items()) if kwargs else ()
    try:
        hit = VIEW_STEPS.find(func, rule, args, kwargs, (WrappedDomainTensor, func, id(spec), shape, args[1:], rest))
    except TypeError:
        return NotImplemented
    if not hit:
        return NotImplemented
    _, compute, extra, extra_kwargs, out_spec, out_ndim, changes_layout = hit
    # NOTE: which results torch makes as views, and their strides, depend on the whole tensor's sizes, strides and
    # storage offset and the arguments only; a view one process raises on is the dispatcher's to raise on every rank
    answer = one_process(func, args, kwargs or {}, (x._whole, x._strides, x._offset, x._local.dtype, args[1:], rest)) \
        if func in VIEW_FUNCTIONS else None
    if answer is not None and answer.error is not None:
        return NotImplemented
    with _Disabled():
        try:
            out = compute(x._differentiable_local(), *extra, **extra_kwargs)
        except Exception:  # noqa: BLE001 - the dispatcher runs it again and raises it everywhere
            return NotImplemented
        if type(out) is not _Tensor or (out_ndim is not None and out.ndim != out_ndim):
            return NotImplemented
    if changes_layout and spec.comm.size > 1:
        journal_layout_change(func, out_spec)
    return record_views(DomainTensor._from_local(out, out_spec), func, args, kwargs or {}, answer)


# NOTE: ``.grad`` is a metadata query the dispatcher answers first, laid out as the whole tensor (``dispatch.grads``)
SHORT.update({f: _metadata for f in METADATA if f not in GRADIENT_CALLS})
SHORT.update({f: _global_size for f in GLOBAL_SIZES})
# NOTE: a wrapper's data_ptr() raises, by the dispatcher, naming what to call instead
WRAPPED_SHORT.update({f: _metadata for f in METADATA if f not in GRADIENT_CALLS and f is not torch.Tensor.data_ptr})
WRAPPED_SHORT.update({f: _global_size_wrapped for f in GLOBAL_SIZES})
