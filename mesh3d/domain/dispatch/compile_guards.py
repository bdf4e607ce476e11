"""``guard_filter``: Dynamo's guards on mesh3d's own code dropped, the guards that decide a graph kept.

Compiled with domain tensors, Dynamo traces the dispatcher and the op rules, and guards every object that trace
read: mesh3d's modules, functions and their code objects, closures and defaults, builtins such as ``len``, and
the classes of the domain spec, about 250 guards for a 4-conv stack against 30 for plain tensors. Dynamo checks
them before every call, and between two training steps they fall out of the CPU caches: measured on this CPU
(2 cores), one cold check of the stack's guards took 190 us against 70 us for the same stack on plain tensors, a
6% step-time tax at D=1 on a small field.

``guard_filter`` (a ``torch.compile`` ``guard_filter_fn``) keeps every guard on the input and its spec (the layout
decides the graph: sizes, sharded dim, rank), on user code and tensors, on the global state, on mesh3d's settings
(``domain.window_overlap``, ``domain.attention_mode``: a change recompiles) and on the rule tables' lengths (a
rule registered later recompiles); it drops only the identity guards on mesh3d's own code: a module, class,
function or builtin that mesh3d's source never replaces while a process runs, and the field defaults of mesh3d's
dataclasses (torch 2.11 reads them through a Python lambda on every call: 3 to 5% of a small D=1 step there); and
the identity guards on torch's own internals that tracing the dispatcher reads (Dynamo's polyfills, ``torch._tensor``,
a namedtuple's ``tuple.__new__``), which torch never replaces either. ``Plan(compile=...)`` passes it; a model
compiled by hand takes it as below.

Usage::

    step = torch.compile(model, options={"guard_filter_fn": domain.guard_filter})
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["guard_filter"]

#: Guards on an object's identity or type (never on a value a setting holds).
IDENTITY_GUARDS = frozenset({"ID_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH", "MODULE_MATCH", "CLASS_MATCH",
                             "TYPE_MATCH", "NOT_PRESENT_IN_GENERIC_DICT", "DUPLICATE_INPUT"})

#: A closure scope Dynamo could not name, as a whole (``G['___unnamed_scope_140077414410560_c1']``): its type.
_UNNAMED_SCOPE = re.compile(r"G\['___unnamed_scope_\d+_c\d+'\]")

#: Parts of a guard's source naming a function's own internals (its code, closure cells or defaults), or a class's
#: dataclass field defaults (torch 2.11 guards those of ``Step`` and ``Window`` through a Python lambda per call).
_FUNCTION_PARTS = ("__code__", "__closure__", "__defaults__", "__kwdefaults__", "__func__", ".fget", "___dataclass_fields(")


#: Sources naming torch's own internals that tracing the dispatcher reads: Dynamo's polyfills (of ``math.prod``,
#: ``dict.update``, ``isinstance`` on ABCs), ``torch._tensor`` (``has_torch_function``), and a namedtuple's
#: ``tuple.__new__`` (``_tuple_new``, in a closure scope Dynamo could not name). Their identity guards were 22 of
#: the 268 a 4-conv stack's domain graph kept, and 12 us of the 44 us a cold guard check took (plain: 20 us).
_TORCH_INTERNALS = ("__import_torch_dot__dynamo_dot_polyfills", "__import_torch_dot__tensor", "['_tuple_new']")


def _mesh3d_code(name: str) -> bool:
    """A guard source inside mesh3d's modules or classes, the builtins dict, or a domain tensor's spec
    (``L['x']._spec...``)."""
    return "__import_mesh3d" in name or "__subclass_DomainTensor" in name or "__builtins_dict" in name \
        or "._spec" in name


def _torch_internal(name: str) -> bool:
    """A guard source naming one of torch's internals (above), or the bare closure scope holding one."""
    return any(part in name for part in _TORCH_INTERNALS) or _UNNAMED_SCOPE.fullmatch(name) is not None


def _dropped(entry: Any) -> bool:
    name = entry.name
    if _torch_internal(name):
        return entry.is_global and entry.guard_type in IDENTITY_GUARDS  # NOTE: torch never replaces these
    if not _mesh3d_code(name):
        return False
    if any(part in name for part in _FUNCTION_PARTS):
        return True  # NOTE: mesh3d's functions are never patched while a process runs; a rule change is seen by RULES
    return entry.is_global and entry.guard_type in IDENTITY_GUARDS


def guard_filter(entries: list[Any]) -> list[bool]:
    """For ``torch.compile(..., options={"guard_filter_fn": guard_filter})``: which guards to keep (see above).

    Usage: ``torch.compile(model, options={"guard_filter_fn": domain.guard_filter})``
    """
    return [not _dropped(entry) for entry in entries]
