"""The one domain dispatcher: binds an op to its rule, does the exchanges the rule declares, wraps the result.

Usage: not called directly; ``DomainTensor.__torch_function__`` sends every torch call here.

For each call it picks, in order: for an operator of ``torch.ops``, the torch function it implements or its own rule
(``mesh3d.domain.dispatch.operators``: an operator is never run on a shard unruled); a metadata query (``.dtype``,
``.device`` ...: answered from the
local shard, on the DomainTensor itself so autograd hooks attach to the right node); a size query
(``.shape``, ``size()``, ``numel()``, ``len()``, ``stride()``: answered for the whole tensor); the op's rule
when some input is sharded (the rule returns a ``step.Step``: the requirements are resolved here,
the local function is called on plain tensors and the results are wrapped); for replicated values
only, the op itself (every rank holds the same value, so any op is right); otherwise it raises
``NotImplementedError`` naming the op: an unsupported op is never silently wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_compiling, is_dynamo_compiling

from mesh3d._torch_private import (
    data_dependent_errors, disable_torch_function_subclass, is_operator, never_traced,
    random_draws_saved_under_traced_checkpoints, run_autograd_function, running_compiled_backward)
from mesh3d.domain.comm.collectives import scale_grad
from mesh3d.domain.comm.divergence import JOURNAL
from mesh3d.domain.core.copied_views import has_copy_marks, refuse_write_through_copy
from mesh3d.domain.core.settings import SETTINGS, traced
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, detach_in_place, is_wrapper, unwrap, wrap
from mesh3d.domain.core.trees import tree_map
from mesh3d.domain.dispatch.executor import (
    STEP_TAP, changes_layout, op_label, run_step, telling_peers_of_failure)
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.layout_registry import LAYOUTS, RegisteredLayout
from mesh3d.domain.dispatch.operators import COMPILED_GRAPH_RUNTIME, autograd_function_target, operator_target
from mesh3d.domain.dispatch.queries import DATA_GET, global_size_answer, is_global_size, is_metadata
from mesh3d.domain.dispatch.registry import op_name, writes_into_first
from mesh3d.domain.dispatch.step import Step
from mesh3d.domain.dispatch.view_semantics import VIEW_FUNCTIONS, one_process
from mesh3d.domain.dispatch.writes import record_views, written_into_wrapper

__all__ = ["dispatch", "dispatch_autograd_function", "redispatch", "run_step"]


def _replicated_dtensor_to_local(o: Any) -> Any:
    """A DTensor replicated on every mesh dim (a ``"replicate"``-style parameter) → its local tensor.

    Every model rank holds the same value and computes the same thing with it; ``to_local``'s
    backward hands the gradient back as a ``Replicate`` DTensor. Sharded DTensors are left alone:
    the op then fails loudly rather than computing with a shard as if it were whole.
    """
    if _is_dtensor(o) and all(p.is_replicate() for p in o.placements):
        return o.to_local()
    return o


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor. NOTE: looked up, not imported: DTensor's module (0.8 s to import) is loaded by
    whatever made one, and a process that never does (a domain-only run, a launcher) does not pay for it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _dispatch_ruled(func: Callable, args: tuple, kwargs: dict, lead: DomainTensor, entry: RegisteredLayout) -> Any:
    """An op whose leading input is laid out as ``entry`` says: its rule in that layout's table, or a refusal naming it
    on every rank (before any exchange)."""
    spec = lead._spec
    if not entry.traceable and is_dynamo_compiling():
        # NOTE: the storage subclass, whose rules Dynamo inlines: graph rules plan halos in numpy, which Dynamo cannot
        # trace, so each such op is a graph break, run eagerly. Wrapper tensors' rules run on fake shards instead
        # (docs/domain.md, "Graphs and meshes"); one that must read values refuses there, and Dynamo breaks the graph.
        return _eager(func, args, kwargs, lead, entry)
    rule = entry.rules.get(func)
    if rule is None:
        raise NotImplementedError(entry.refusal(op_name(func), spec))
    if STEP_TAP.args is args:  # NOTE: ``dispatch.kept`` asked for this call's step, to keep it
        rule = STEP_TAP.tapped(rule, lead, entry.journal)
    # NOTE: compiled, a rule runs once, at trace time: no journal entry, no telling peers from inside the graph;
    # each exchange in it (mesh3d::exchange_rows) still checks the peers' headers when it runs.
    if traced() and not entry.traceable:
        return _run_on_fake_shards(func, rule, args, kwargs)
    if spec.comm.size == 1 or traced():
        result = rule(*args, **kwargs)
        return run_step(result) if isinstance(result, Step) else result
    if entry.journal is not None:
        JOURNAL.record(op_label(func), entry.journal(spec))
    return telling_peers_of_failure(spec.comm, func,
                                     lambda: _run_rule_checked(func, rule, lead, args, kwargs, entry.journal is None))


def _run_on_fake_shards(func: Callable, rule: Callable, args: tuple, kwargs: dict) -> Any:
    """A rule of a layout Dynamo cannot inline, run on a wrapper tensor's fake shards; where it reads a value that a
    fake shard does not hold, a ``NotImplementedError`` (Dynamo breaks the graph and runs the op eagerly)."""
    try:
        result = rule(*args, **kwargs)
    except data_dependent_errors() as e:
        raise NotImplementedError(f"{op_name(func)} under torch.compile reads values of its tensors, which a trace on "
                                  "fake shards cannot: it runs eagerly (a graph break)") from e
    return run_step(result) if isinstance(result, Step) else result


@never_traced("mesh3d: an op on a domain tensor whose rules do not trace runs eagerly")
def _eager(func: Callable, args: tuple, kwargs: dict, lead: DomainTensor, entry: RegisteredLayout) -> Any:
    return _dispatch_ruled(func, args, kwargs, lead, entry)


def _scan(args: tuple, kwargs: dict) -> tuple[list[DomainTensor], DomainTensor | None, bool]:
    """Domain tensors among the arguments (and inside one level of lists); the one whose layout picks the rule table
    (the first of the highest ``RegisteredLayout.priority``: a graph, else a grid, else a strided slab, else a slab;
    None when every one is replicated); whether any argument is a DTensor."""
    found: list[DomainTensor] = []
    dtensor = False
    for group in (args, kwargs.values()):
        for a in group:
            items = a if isinstance(a, (list, tuple)) else (a,)
            for t in items:
                if isinstance(t, DomainTensor):
                    found.append(t)
                elif _is_dtensor(t):
                    dtensor = True
    lead, rank = None, 0
    priority = LAYOUTS.priority
    for t in found:
        at = priority[t._spec.layout]
        if at > rank:
            lead, rank = t, at
    return found, lead, dtensor


def dispatch(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on domain tensors (see module docstring).

    Usage: ``DomainTensor.__torch_function__`` calls ``dispatch(func, types, args, kwargs)``
    """
    if is_dynamo_compiling():  # NOTE: wrapper tensors refuse compile (``core.wrapped``)
        return _dispatch(func, types, args, kwargs)
    first = args[0] if args else None
    if isinstance(first, DomainTensor) and (first._wraps or has_copy_marks(first)) and writes_into_first(func) and \
            not is_metadata(func) and func not in _DETACHING:
        refuse_write_through_copy(first, op_name(func))  # NOTE: a view made as a copy, or a tensor that has one
        if first._wraps:
            return written_into_wrapper(_dispatch, func, types, args, kwargs)
    answer: Any = False  # NOTE: False: not asked (``record_views`` asks); None: no one-process answer
    if func in VIEW_FUNCTIONS and SETTINGS.value.wrapper:
        answer = one_process(func, args, kwargs)
        if answer is not None and answer.error is not None:  # NOTE: on every rank, before the rule: a rank whose
            raise RuntimeError(answer.error)  # shard's strides allow the view would run it where its peers raise
    out = _dispatch(func, types, args, kwargs)
    if is_compiling():  # NOTE: AOTAutograd tracing wrapper tensors' rules: a checkpointed region's
        random_draws_saved_under_traced_checkpoints()  # random draws keep eager's numbers (the function says how)
    return record_views(out, func, args, kwargs, answer) if SETTINGS.value.wrapper else out


_DATA_PTR = torch.Tensor.data_ptr
#: In-place by name, but writing no values: they change what autograd records of the tensor itself.
_DETACHING = (torch.Tensor.detach_, torch.detach_)


def _dispatch(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    if is_operator(func):  # torch.ops.ns.op[.overload]: its rule, the torch function it implements, or a refusal
        if COMPILED_GRAPH_RUNTIME.depth or running_compiled_backward():
            # NOTE: a compiled graph's runtime: traced on the shard (the rules ran at trace time), it runs on it
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        func, args, kwargs = operator_target(func, args, kwargs)
    gradient = None if is_dynamo_compiling() else GRADIENT_CALLS.get(func)
    if gradient is not None:  # ``.grad``, ``torch.autograd.grad``/``backward``: answered for the whole tensor
        return gradient(*args, **kwargs)
    if is_metadata(func):
        if func is _DATA_PTR and is_wrapper(args[0]):
            raise RuntimeError("x.data_ptr() of a wrapper domain tensor: it has no storage of its own (the shard is "
                               "x.to_local(), the whole tensor x.full_tensor())")
        with disable_torch_function_subclass():
            return func(*args, **kwargs)
    if is_global_size(func) and isinstance(args[0], DomainTensor):
        if is_compiling() and not is_dynamo_compiling():
            # NOTE: torch.compile fakifying the real input sees the shard; traced model code still gets global sizes.
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        return global_size_answer(func, args[0], args[1:], kwargs)
    if func == DATA_GET and isinstance(args[0], DomainTensor):
        return wrap(unwrap(args[0]).data, args[0]._spec)
    found, lead, dtensor = _scan(args, kwargs)
    if dtensor:
        args, kwargs = tree_map(_replicated_dtensor_to_local, args), tree_map(_replicated_dtensor_to_local, kwargs)
    if lead is None:
        return _run_replicated(func, found[0]._spec, args, kwargs)
    return _dispatch_ruled(func, args, kwargs, lead, LAYOUTS.of(lead._spec.layout))


def dispatch_autograd_function(cls: type, args: tuple, kwargs: dict) -> Any:
    """``cls.apply(*args, **kwargs)`` for a ``torch.autograd.Function`` called with a domain tensor: through its rule,
    as torch's or mesh3d's own Function, or refused (``operators.autograd_function_target``).

    Usage: ``route_autograd_function_calls((DomainTensor, ...), dispatch_autograd_function)`` (``mesh3d.domain`` does this)
    """
    target = autograd_function_target(cls)
    if target is None:
        return run_autograd_function(cls, args, kwargs)
    return dispatch(target, (DomainTensor,), args, kwargs)


def redispatch(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` on domain tensors from inside a rule, through this dispatcher explicitly.

    Usage: ``return redispatch(torch.Tensor.select, one, take_one, 0)``

    NOTE: Dynamo, unlike eager torch, turns subclass dispatch off inside ``__torch_function__``: traced, a rule's own
    ``a - b`` would run on the shards as a plain op (``nesting.NestedDispatchCheck`` finds such calls)."""
    return dispatch(func, (), args, kwargs)


def _run_rule_checked(func: Callable, rule: Callable, lead: DomainTensor, args: tuple, kwargs: dict,
                      journal: bool) -> Any:
    """Run a rule on a multi-rank domain; with ``journal``, record what it ran in the op journal its peers check."""
    result = rule(*args, **kwargs)
    if not journal:  # NOTE: the layout's own journal entry was made before the rule ran
        return run_step(result) if isinstance(result, Step) else result
    if isinstance(result, Step):
        if changes_layout(result, lead):  # what this rank ran, in global terms
            out = result.out
            JOURNAL.record(op_label(func), (out.dim, sum(out.sizes)) if out is not None and out.sizes else (None, 0))
        return run_step(result)
    JOURNAL.record(op_label(func), (lead._spec.dim, sum(lead._spec.sizes)))  # a composite rule (reductions, losses)
    return result


def _run_replicated(func: Callable, spec: DomainSpec, args: tuple, kwargs: dict) -> Any:
    """Every input is replicated over the domain: the plain op is the one-process op."""
    if func is torch.Tensor.detach_ or func is torch.detach_:
        return detach_in_place(args[0])
    size = spec.comm.size

    def prepare(o: Any) -> Any:
        # Parameters meeting a replicated value: each of the D ranks computes the same thing, so
        # each keeps 1/D of their gradient (the domain sum then gives the one-process gradient).
        if size > 1 and isinstance(o, torch.Tensor) and not isinstance(o, DomainTensor) and o.requires_grad:
            return scale_grad(o, 1.0 / size)
        return unwrap(o)

    target = args[0] if args and writes_into_first(func) else None
    if isinstance(target, DomainTensor) or not isinstance(target, torch.Tensor):
        target = None
    out = func(*((target, *tree_map(prepare, args[1:])) if target is not None else tree_map(prepare, args)),
               **tree_map(prepare, kwargs))
    if target is not None:
        # NOTE: a plain tensor written with replicated values holds values computed from the domain tensor: it
        # becomes a replicated domain tensor, so what follows from it keeps the replicated gradient convention.
        target.__class__ = DomainTensor
        target._spec = spec  # type: ignore[attr-defined]  # re-classed on the line above
        return target if out is target else out
    plain = tuple(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and not isinstance(t, DomainTensor))
    return tree_map(lambda o: adopt(o, spec, plain) if isinstance(o, torch.Tensor) else o, out)
