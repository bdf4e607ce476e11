"""Operators of ``torch.ops`` called directly on domain tensors: ATen's (``torch.ops.aten.sum.default(xs)``) and
libraries' custom ops (``torch.ops.mylib.blur.default(xs)``). No back door: each is ruled or refused.

Usage: not called directly; the dispatcher sends every operator here first::

    target = operator_target(func, args, kwargs)   # (torch function, args, kwargs) that computes the same

An operator with a domain tensor argument runs, in order of preference:

1. the rule registered for it or its packet (``domain.register(torch.ops.mylib.blur, domain.window(...))``);
2. for an ATen operator, the torch function it implements, through that function's rule: ``aten.sum.dim_IntList``
   is ``torch.Tensor.sum`` with the same arguments (ATen's schemas and torch's Python signatures are generated from
   the same definitions, so the arguments bind alike), ``aten.convolution`` is ``F.conv2d`` or ``F.conv_transpose2d``
   by its ``transposed`` flag and rank, ``aten._softmax`` is ``torch.softmax``, ``aten.sym_size`` is ``Tensor.size``;
3. otherwise it raises ``NotImplementedError`` naming the operator (``torch.ops.aten.logcumsumexp.default``) and the
   way out: the torch function to call instead, ``domain.register``, or ``.full_tensor()``.

NOTE: the runtime of a compiled graph calls operators on its inputs with the rules already applied at trace time.
torch 2.13 runs a compiled forward with subclass dispatch off, so none arrive from it; its backward (AOTAutograd's
node, running on the tensors the forward saved) is recognised by the autograd engine's current node, and any other
runtime that runs graphs with subclass dispatch on says so with ``COMPILED_GRAPH_RUNTIME.running()``: the only ways
to run an operator on a shard unruled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling
import torch.nn.functional as F

from mesh3d._torch_private import OpOverload, constant_in_compiled_graphs, function_apply_key, op_schema
from mesh3d.domain.dispatch.queries import GLOBAL_SIZES, METADATA
from mesh3d.domain.dispatch.layout_registry import LAYOUTS
from mesh3d.domain.dispatch.registry import RuleTable, load_shipped_rules, op_name, rules_for

__all__ = ["COMPILED_GRAPH_RUNTIME", "CompiledGraphRuntime", "OperatorPlan", "autograd_function_target", "operator_plan",
           "operator_target"]

#: Where an ATen operator's torch function may live, by the operator's name prefix (a plan names the place, so a
#: compiled graph finds the function with a constant ``getattr``).
_WHERE = {"fft": torch.fft, "special": torch.special, "linalg": torch.linalg, "Tensor": torch.Tensor, "torch": torch,
          "F": F}
_NAMESPACES = (("fft_", "fft"), ("special_", "special"), ("linalg_", "linalg"), ("", "Tensor"), ("", "torch"), ("", "F"))
#: Operators whose torch function has another name (size queries of the symbolic-shape API).
_RENAMED = {"sym_size": "size", "sym_stride": "stride", "sym_numel": "numel", "sym_storage_offset": "storage_offset"}


class CompiledGraphRuntime:
    """Whether a compiled graph is running with subclass dispatch on (then its operators run on the shards as traced).

    Usage: ``with COMPILED_GRAPH_RUNTIME.running(): compiled(*inputs)``
    """

    def __init__(self) -> None:
        self.depth = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


COMPILED_GRAPH_RUNTIME = CompiledGraphRuntime()


def _answered(func: Callable) -> bool:
    """A torch function the dispatcher can run on domain tensors: ruled in some layout, or a query it answers."""
    return _ruled(func) or func in METADATA or func in GLOBAL_SIZES


def _ruled(func: Callable) -> bool:
    """Whether some registered layout (``dispatch.layout_registry``) has a rule for ``func``."""
    return any(func in t for t in LAYOUTS.tables())


def _named_function(name: str, method: bool) -> tuple[tuple[str, str] | None, Callable | None]:
    """(where, attribute) of the torch function named ``name`` that the dispatcher can run, or None; and the first
    torch function of that name that exists at all. ``method``: the operator's first argument is ``self``, so the
    ``Tensor`` method takes its arguments in its order (``aten.where.self(condition, self, other)`` is
    ``torch.where``, not ``Tensor.where``)."""
    name = _RENAMED.get(name, name)
    exists = None
    for prefix, where in _NAMESPACES:
        if not name.startswith(prefix) or (where == "Tensor" and not method):
            continue
        func = getattr(_WHERE[where], name[len(prefix):], None)
        if func is None or not callable(func):
            continue
        exists = exists or func
        if _answered(func):
            return (where, name[len(prefix):]), exists
    return None, exists


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten.convolution`` as the functional it implements (1, 2 or 3 spatial dims)."""
    nd = len(input.shape) - 2
    if nd not in (1, 2, 3):
        return None
    if transposed:
        return getattr(F, f"conv_transpose{nd}d"), (input, weight, bias, stride, padding, output_padding, groups,
                                                     dilation), {}
    return getattr(F, f"conv{nd}d"), (input, weight, bias, stride, padding, dilation, groups), {}


def _softmax(input, dim, half_to_float):
    return None if half_to_float else (torch.softmax, (input, dim), {})


def _log_softmax(input, dim, half_to_float):
    return None if half_to_float else (torch.log_softmax, (input, dim), {})


#: ATen operators whose arguments differ from their torch function's: a translation to it (None: cannot).
_SPECIAL = {"convolution": _convolution, "_softmax": _softmax, "_log_softmax": _log_softmax}

#: A positional argument with no default (a plan is made of constants: no sentinel object).
_NO_DEFAULT = "<mesh3d: no default>"

#: A plan: (kind, where, attribute, positional names, their defaults, keyword-only names, refusal). ``kind``:
#: ``ruled`` (the operator's own rule), ``as_given`` (a packet: the torch function, arguments as given), ``bound``
#: (an overload: the torch function, arguments by its schema), ``special`` (``_SPECIAL[attribute]``), ``refused``.
OperatorPlan = tuple

_PLANNED: dict[tuple, OperatorPlan] = {}


def _refusal_text(func: Any, why: str, instead: Callable | None) -> str:
    name = op_name(func)
    ways = [f"call {op_name(instead)} instead (it has a rule)"] if instead is not None and _answered(instead) else []
    ways.append(f"register a rule with domain.register({name}, ...) (for a custom op in a few lines: "
                "domain.elementwise(), domain.local(...), domain.window(...) or domain.whole_dim(...); docs/domain.md, "
                "'Custom ops')")
    ways.append("call it on .full_tensor()")
    return (f"{name} {why}: mesh3d will not run it on a domain tensor, because the local answer could differ from the "
            f"one-process answer. To run it, {', '.join(ways[:-1])}, or {ways[-1]}")


def _refused(func: Any, why: str, instead: Callable | None = None) -> OperatorPlan:
    return ("refused", "", "", (), (), (), _refusal_text(func, why, instead))


def _positional_names(target: Callable) -> list[str] | None:
    """The positional parameter names of a Python-defined function; None for a builtin (its binding is generated from
    the same schema). NOTE: ``F.max_pool2d`` is ``boolean_dispatch``'s ``(*args, **kwargs)`` wrapper: the functions it
    chooses between (in its closure) have the one signature it forwards to."""
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        inner = [c.cell_contents for c in (getattr(target, "__closure__", None) or ()) if inspect.isfunction(c.cell_contents)]
        found = {tuple(n for n in (_positional_names(f) or ())) for f in inner}
        return list(found.pop()) if len(found) == 1 else []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _signature_mismatch(target: Callable, positional: list) -> str:
    """Where a Python-defined torch function (``F.elu``) names its parameters otherwise than the operator's schema
    (after the first); "" where they agree, or where the function is a builtin generated from the same schema."""
    names = _positional_names(target)
    if names is None:
        return ""
    if not names:
        return "its Python parameters cannot be read"
    for i, a in enumerate(positional[1:], start=1):
        if i >= len(names) or names[i] != a.name:
            return f"argument {i} is {a.name!r} in the schema, {names[i] if i < len(names) else 'absent'!r} there"
    return ""


def _make_plan(func: Any) -> OperatorPlan:
    if _ruled(func):
        return ("ruled", "", "", (), (), (), "")
    packet = func.overloadpacket if isinstance(func, OpOverload) else func
    namespace = func.namespace if isinstance(func, OpOverload) else getattr(func, func.overloads()[0]).namespace
    if namespace != "aten":
        if load_shipped_rules(namespace) and _ruled(func):  # a library's ops mesh3d ships rules for
            return ("ruled", "", "", (), (), (), "")
        return _refused(func, "is a custom op with no domain rule")
    name = packet.__name__
    if name in _SPECIAL and isinstance(func, OpOverload):
        return ("special", "", name, (), (), (), _refusal_text(func, "has no domain rule for these arguments", None))
    first = op_schema(func).arguments[:1] if isinstance(func, OpOverload) else ()
    found, exists = _named_function(name, method=not first or first[0].name == "self")
    if found is None:
        return _refused(func, "has no domain rule" + (f" (nor has {op_name(exists)})" if exists else ""), exists)
    target = getattr(_WHERE[found[0]], found[1])
    if not isinstance(func, OpOverload):
        return ("as_given", *found, (), (), (), "")
    schema = op_schema(func)
    if schema.is_mutable and not name.endswith("_"):
        return _refused(func, "writes into an out= argument", target)
    if len(schema.returns) > 1:  # NOTE: aten.adaptive_max_pool2d returns (out, indices), F.adaptive_max_pool2d one
        return _refused(func, f"returns {len(schema.returns)} results where {op_name(target)} may return another "
                              "number", target)
    positional = [a for a in schema.arguments if not a.kwarg_only]
    mismatch = _signature_mismatch(target, positional)
    if mismatch:  # NOTE: F.elu(input, alpha, inplace) against aten.elu(self, alpha, scale, input_scale)
        return _refused(func, f"takes its arguments otherwise than {op_name(target)} ({mismatch})", target)
    why = f"cannot run as {op_name(target)} with these arguments (its schema: {schema})"
    return ("bound", *found, tuple(a.name for a in positional),
            tuple(a.default_value if a.has_default_value() else _NO_DEFAULT for a in positional),
            tuple(a.name for a in schema.arguments if a.kwarg_only), _refusal_text(func, why, target))


@constant_in_compiled_graphs  # NOTE: a fact about the operator and the rules registered: a graph constant
def operator_plan(func: Any, changes: int) -> OperatorPlan:
    """How ``func`` runs on domain tensors (see ``OperatorPlan``), made once per operator and state of the rule tables
    (``changes``). Constants only, so a compiled graph carries it.

    Usage: ``kind, where, attribute, *_ = operator_plan(torch.ops.aten.sum.default, RuleTable.changes)``
    """
    key = (func, changes)
    plan = _PLANNED.get(key)
    if plan is None:
        plan = _PLANNED[key] = _make_plan(func)
    return plan


def _bind(names: tuple, defaults: tuple, keyword_only: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The schema's positional arguments in order (trailing ones at their default dropped), its keyword-only ones by
    name; None if the call does not fit the schema."""
    if len(args) > len(names) or any(k not in names and k not in keyword_only for k in kwargs):
        return None
    values = list(args)
    for name, default in zip(names[len(args):], defaults[len(args):]):
        if name in kwargs:
            values.append(kwargs[name])
        elif default != _NO_DEFAULT:
            values.append(default)
        else:
            return None
    while len(values) > len(args) and values[-1] == defaults[len(values) - 1]:
        values.pop()
    keywords = {k: v for k, v in kwargs.items() if k in keyword_only}
    # NOTE: torch's Python ``add``/``sub`` take alpha by keyword only; given by position it would pick a deprecated
    # signature (``add(Number alpha, Tensor other)``). Their ``.Scalar`` overloads take it by position.
    if names == ("self", "other", "alpha") and len(values) == 3:
        keywords["alpha"] = values.pop()
    return tuple(values), keywords


def _fits(target: Callable, args: tuple, kwargs: dict) -> bool:
    """Every rule for ``target`` takes these arguments (rules have the torch function's Python signature)."""
    for rule in rules_for(target):
        try:
            inspect.signature(rule).bind(*args, **kwargs)
        except TypeError:
            return False
        except ValueError:  # no signature to read: the rule takes what it is given
            continue
    return True


def operator_target(func: Any, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """The torch function (and its arguments) that computes what the operator ``func`` would, for the dispatcher to
    run through its rule; ``func`` itself where a rule is registered for it. Raises naming ``func`` where none.

    Usage: ``target, args, kwargs = operator_target(torch.ops.aten.sum.default, (xs,), {})  # Tensor.sum``
    """
    kind, where, attribute, names, defaults, keyword_only, refusal = operator_plan(func, RuleTable.changes)
    if kind == "ruled":
        return func, args, kwargs
    if kind == "as_given":
        return getattr(_WHERE[where], attribute), args, kwargs
    if kind == "special":
        call = _SPECIAL[attribute](*args, **kwargs)
        if call is None:
            raise NotImplementedError(refusal)
        return call
    if kind == "refused":
        raise NotImplementedError(refusal)
    target = getattr(_WHERE[where], attribute)
    bound = _bind(names, defaults, keyword_only, args, kwargs)
    if bound is None or (not is_dynamo_compiling() and not _fits(target, *bound)):
        raise NotImplementedError(refusal)
    return target, *bound


#: Modules whose autograd Functions run on domain tensors as they are: torch's own (checkpointing, FSDP, DTensor) see
#: the domain tensor through the torch calls of their forward, and mesh3d's take its shards.
_TRUSTED_FUNCTIONS = ("torch.", "mesh3d.")
#: torch's own Functions that cannot run on domain tensors, with what to do instead. NOTE: reentrant checkpointing's
#: backward calls torch.autograd.backward on the recomputed (domain) outputs with the gradients the engine handed it,
#: which are this rank's shards: refused here, at the forward, on every rank, rather than at a confusing backward.
_REFUSED_FUNCTIONS = {
    "torch.utils.checkpoint.CheckpointFunction": (
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) does not run on domain tensors: its backward "
        "replays the block with this rank's gradient shards as if they were whole. Pass use_reentrant=False (the "
        "non-reentrant checkpoint runs on domain tensors, exactly, and is what torch recommends), or "
        "torch.distributed.algorithms._checkpoint's checkpoint_wrapper with CheckpointImpl.NO_REENTRANT"),
}


def autograd_function_target(cls: Any) -> Callable | None:
    """For ``cls.apply`` called with a domain tensor: ``cls.apply`` if a rule is registered for it (the dispatcher runs
    it), None if ``cls`` is torch's or mesh3d's own (it runs as it is); else raises naming it and the way out.

    Usage: ``target = autograd_function_target(MyFunction)``
    """
    refusal = _REFUSED_FUNCTIONS.get(f"{cls.__module__}.{cls.__qualname__}")
    if refusal is not None:
        raise ValueError(refusal)
    if cls.__module__.startswith(_TRUSTED_FUNCTIONS):
        return None
    target = function_apply_key(cls)
    if _ruled(target) or (load_shipped_rules(cls.__module__) and _ruled(target)):
        return target
    name = f"{cls.__module__}.{cls.__qualname__}.apply"
    raise NotImplementedError(
        f"{name} (a torch.autograd.Function) has no domain rule: mesh3d will not run it on a domain tensor, because "
        "its forward may call kernels mesh3d cannot see (they would compute the shard's answer) and its backward "
        "would get this rank's gradients only. To run it, register a rule with domain.register("
        f"{cls.__qualname__}, ...) (in a few lines: domain.elementwise(), domain.local(...), domain.window(...) or "
        "domain.whole_dim(...); docs/domain.md, 'Custom ops'), or call it on .full_tensor()")
