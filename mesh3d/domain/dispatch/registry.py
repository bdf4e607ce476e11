"""The op registry: torch functions → rules that declare how to compute them on domain-sharded tensors.

Usage::

    from mesh3d.domain.dispatch.registry import register
    @register(torch.nn.functional.conv2d)
    def conv2d_rule(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Step: ...

A rule's own Python signature is the op's signature (torch's argument names and defaults), so
arguments are bound by Python, positionally or by keyword, exactly as torch binds them. A rule
returns a ``step.Step``; ``mesh3d.domain.dispatch.dispatcher`` runs it. Registering a second rule for the same
op raises unless ``override=True`` (a silent replacement would change results elsewhere).
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling

from mesh3d._torch_private import (
    OpOverload, OpOverloadPacket, builtins_replaced_by, constant_in_compiled_graphs, custom_op_overload,
    function_apply_key, is_operator)

__all__ = ["BLOCK_RULES", "GRAPH_RULES", "RULES", "RuleTable", "STRIDED_RULES", "TOKEN_RULES", "load_shipped_rules",
           "inplace_position", "op_name", "register", "rules_for", "writes_inplace", "writes_into_first"]


#: Every rule table by its name: a compiled lookup names its table (see ``_rule_index_at_trace_time``).
_TABLES: dict[str, RuleTable] = {}


class RuleTable:
    """Torch function → rule. One instance, ``RULES``, is what the dispatcher reads.

    Usage: ``RULES.get(torch.nn.functional.conv2d)``, ``RULES.register(f, rule, override=False)``;
    a new table: ``RuleTable("MY_RULES")`` (names are unique in a process).
    """

    #: Rules registered so far in any table (what caches of lookups key on: ``mesh3d.domain.dispatch.operators``).
    changes = 0

    def __init__(self, name: str) -> None:
        if name in _TABLES:
            raise ValueError(f"a rule table named {name!r} exists already; names: {sorted(_TABLES)}")
        self.name = name
        _TABLES[name] = self
        self._rules: dict[Callable, Callable] = {}
        self._listed: list[Callable] = []  # every rule once, for compiled lookups (``get``)

    def register(self, func: Callable, rule: Callable, *, override: bool = False) -> None:
        old = self._rules.get(func)
        if old is not None and old is not rule and not override:
            raise ValueError(
                f"{op_name(func)} already has a domain rule ({getattr(old, '__qualname__', old)}); "
                "pass override=True to replace it on purpose"
            )
        self._rules[func] = rule
        # NOTE: a library imported before mesh3d may have put a Python function in place of a torch builtin
        # (PyTorch Geometric's torch.select, torch.index_select); what reaches __torch_function__ is the builtin
        for builtin in builtins_replaced_by(func):
            self._rules[builtin] = rule
        RuleTable.changes += 1
        if not any(r is rule for r in self._listed):
            self._listed.append(rule)

    def snapshot(self) -> dict[Callable, Callable]:
        """The rules registered now (to ``restore`` later: a test harness putting a process back as it was).

        Usage: ``saved = RULES.snapshot(); ...; RULES.restore(saved)``
        """
        return dict(self._rules)

    def restore(self, rules: dict[Callable, Callable]) -> None:
        """Exactly ``rules`` (a ``snapshot``), dropping any registered since."""
        self._rules.clear()
        self._rules.update(rules)
        for rule in rules.values():
            if not any(r is rule for r in self._listed):
                self._listed.append(rule)
        RuleTable.changes += 1

    def get(self, func: Callable) -> Callable | None:
        if is_dynamo_compiling():
            at = _rule_index_at_trace_time(self.name, func)
            return None if at < 0 else self._listed[at]
        return self._rules.get(func)

    def __contains__(self, func: Callable) -> bool:
        return func in self._rules

    def __iter__(self):
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)


@constant_in_compiled_graphs
def _rule_index_at_trace_time(table_name: str, func: Callable) -> int:
    """Where the table ``table_name``'s rule for ``func`` sits in its ``_listed`` (-1: none), looked up once while
    Dynamo traces.

    NOTE: Dynamo's own dict lookup of a torch function key can miss, and a function returned by a constant-result
    call cannot be guarded; an int can, and ``_listed`` is a plain list Dynamo indexes with guards. The table goes by
    name: torch 2.11's Dynamo takes only constants as a constant-result call's arguments.
    """
    table = _TABLES[table_name]
    rule = table._rules.get(func)
    return -1 if rule is None else table._listed.index(rule)


RULES = RuleTable("RULES")
#: Rules for block-sharded inputs (``mesh3d.domain.layouts.blocks``; registered by ``mesh3d.domain.ops.blocks.rules``).
BLOCK_RULES = RuleTable("BLOCK_RULES")
#: Rules for token grids (blocks flattened into tokens, ``mesh3d.domain.layouts.tokens``; ``mesh3d.domain.ops.tokens.rules``).
TOKEN_RULES = RuleTable("TOKEN_RULES")
#: Rules for graph layouts (nodes and edges split by a partition; ``mesh3d.domain.ops.graph``).
GRAPH_RULES = RuleTable("GRAPH_RULES")
#: Rules for strided layouts (``DomainSpec.outer > 1``; registered by ``mesh3d.domain.ops.strided``).
STRIDED_RULES = RuleTable("STRIDED_RULES")


def _keys(func: Any) -> list:
    """The dispatcher's keys for ``func``: itself; a packet's overloads too; a ``torch.library.custom_op``'s overload."""
    overload = custom_op_overload(func)
    if overload is not None:
        return [overload]
    if isinstance(func, type) and issubclass(func, torch.autograd.Function):
        return [function_apply_key(func)]
    owner = getattr(func, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function) and getattr(func, "__name__", "") == "apply":
        # NOTE: MyFunction.apply is a new bound method at each access, equal while Function.apply is the same function;
        # mesh3d routes Function.apply only while a domain tensor can exist, so the key binds torch's own
        return [function_apply_key(owner)]
    if isinstance(func, OpOverloadPacket):
        return [func, *(getattr(func, name) for name in func.overloads())]
    return [func]


def register(*funcs: Any, rule: Any = None, override: bool = False) -> Any:
    """Register a domain rule for every function or operator in ``funcs``.

    Usage::

        @domain.register(F.conv2d)                                      # a rule: the op's signature, returns a Step
        def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Step: ...

        domain.register(torch.ops.mylib.blur, domain.window(dim=-1, kernel=5, padding=2))   # a custom op

    ``funcs``: torch functions, ``torch.ops`` operators (a packet registers every overload),
    ``torch.library.custom_op`` functions or ``torch.autograd.Function`` classes. ``rule``: a function as above
    (slabs), or one of the custom-op helpers (``domain.elementwise()``, ``domain.local(...)``,
    ``domain.window(...)``, ``domain.whole_dim(...)``), which rule every layout they can. Without a rule it
    decorates. A second rule for the same op raises unless ``override=True`` (a silent replacement would change
    results elsewhere).
    """
    if rule is None and funcs and hasattr(funcs[-1], "rules") and not callable(funcs[-1]):
        funcs, rule = funcs[:-1], funcs[-1]  # domain.register(op, domain.window(...))
    if not funcs:
        raise TypeError("domain.register: name the function or operator to rule, e.g. "
                        "domain.register(torch.ops.mylib.op, domain.elementwise())")

    def deco(made: Any) -> Any:
        per_layout = made.rules if hasattr(made, "rules") and not callable(made) else None
        for f in funcs:
            for key in _keys(f):
                if per_layout is None:
                    RULES.register(key, made, override=override)
                    continue
                for table_name, layout_rule in per_layout(key).items():
                    _TABLES[table_name].register(key, layout_rule, override=override)
        return made

    return deco if rule is None else deco(rule)


def rules_for(func: Callable) -> list[Callable]:
    """Every rule registered for ``func``, one per layout that has one.

    Usage: ``rules_for(torch.Tensor.sum)``
    """
    return [t._rules[func] for t in _TABLES.values() if func in t._rules]


@constant_in_compiled_graphs  # NOTE: a fact about the function alone: a constant in a compiled graph
def op_name(func: Callable) -> str:
    """A readable name such as ``torch.flip``, ``torch.Tensor.add``, ``torch.nn.functional.conv2d`` or
    ``torch.ops.aten.sum.default``.

    Usage: ``op_name(torch.Tensor.add)  # 'torch.Tensor.add'``
    """
    if is_operator(func):  # torch.ops.ns.op[.overload]: the name it is called by
        first = func if isinstance(func, OpOverload) else getattr(func, func.overloads()[0])  # type: ignore[attr-defined]
        return f"torch.ops.{first.namespace}.{func.__name__}"
    owner = getattr(func, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):  # MyFunction.apply: the class's name
        return f"{owner.__module__}.{owner.__qualname__}.apply"
    if isinstance(owner, types.GetSetDescriptorType):  # x.real, x.imag read through the property's __get__
        return f"torch.Tensor.{owner.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if "<locals>" in name:  # a wrapper made by a factory (F.max_pool2d is boolean_dispatch's fn): its own name
        name = getattr(func, "__name__", name)
    name = name.replace("_VariableFunctionsClass.", "").replace("TensorBase.", "Tensor.")
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch._C") or not module:
        return f"torch.{name}"
    return f"{module}.{name}"


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


@constant_in_compiled_graphs  # NOTE: a fact about the function alone: a constant in a compiled graph
def writes_into_first(func: Callable) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``copy_``, ``x[i] = v``, ``x += y``).

    Usage: ``if writes_into_first(func) and not isinstance(args[0], DomainTensor): ...``
    """
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS


def inplace_position(func: Callable) -> int | None:
    """Where ``func`` takes an ``inplace`` argument (``F.relu(x, inplace=True)``), or None where it has none.

    Usage: ``at = inplace_position(F.relu)  # 1``
    """
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: no inplace parameter
        return None
    return names.index("inplace") if "inplace" in names else None


def writes_inplace(args: tuple, kwargs: dict | None, at: int | None) -> bool:
    """Whether a call passes a true ``inplace`` (by name, or at position ``at``: ``inplace_position``'s answer).

    Usage: ``if writes_inplace(args, kwargs, inplace_position(func)): ...``
    """
    if kwargs and "inplace" in kwargs:
        return bool(kwargs["inplace"])
    return at is not None and len(args) > at and bool(args[at])


#: Rules mesh3d ships for a third-party library, by the library's top-level module: the mesh3d module whose
#: ``register_rules()`` registers them. NOTE: called when one of the library's autograd Functions meets a domain tensor
#: with no rule (the refusal path asks here first), not at mesh3d's import: the library may be absent, importing it
#: costs, and no import hook is installed for the process. Registering again is harmless (a harness that puts the
#: tables back as they were removes them). By name (importlib): the rules live in the ops layer above this one.
#: A library's custom-op namespaces are keys too (a ``torch.ops.<namespace>`` op with no rule asks here first).
SHIPPED_RULES = {"torch_harmonics": "mesh3d.domain.ops.torch_harmonics",
                 "disco_kernels": "mesh3d.domain.ops.torch_harmonics",
                 "attention_kernels": "mesh3d.domain.ops.torch_harmonics"}


def load_shipped_rules(module: str) -> bool:
    """Register the rules mesh3d ships for the library ``module`` belongs to; whether it ships any.

    Usage: ``if load_shipped_rules(cls.__module__): ...  # look the rule up again``
    """
    path = SHIPPED_RULES.get(module.split(".", 1)[0])
    if path is None:
        return False
    importlib.import_module(path).register_rules()
    return True
