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
dataclasses (torch 2.11 reads them through a Python lambda on every call: 3 to 5% of a small D=1 step there). ``Plan(compile=...)`` passes it; a
model compiled by hand takes it as below.

Usage::

    step = torch.compile(model, options={"guard_filter_fn": domain.guard_filter})
"""

from __future__ import annotations

from typing import Any

__all__ = ["guard_filter"]

#: Guards on an object's identity or type (never on a value a setting holds).
_IDENTITY = frozenset({"ID_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH", "MODULE_MATCH", "CLASS_MATCH", "TYPE_MATCH",
                       "NOT_PRESENT_IN_GENERIC_DICT", "DUPLICATE_INPUT"})

#: Parts of a guard's source naming a function's own internals (its code, closure cells or defaults), or a class's
#: dataclass field defaults (torch 2.11 guards those of ``Step`` and ``Window`` through a Python lambda per call).
_FUNCTION_PARTS = ("__code__", "__closure__", "__defaults__", "__kwdefaults__", "__func__", ".fget", "___dataclass_fields(")


def _mesh3d_code(name: str) -> bool:
    """A guard source inside mesh3d's modules, the builtins dict, or a domain tensor's spec (``L['x']._spec...``)."""
    return "__import_mesh3d" in name or "__builtins_dict" in name or "._spec" in name


def _dropped(entry: Any) -> bool:
    name = entry.name
    if not _mesh3d_code(name):
        return False
    if any(part in name for part in _FUNCTION_PARTS):
        return True  # NOTE: mesh3d's functions are never patched while a process runs; a rule change is seen by RULES
    return entry.is_global and entry.guard_type in _IDENTITY


def guard_filter(entries: list[Any]) -> list[bool]:
    """For ``torch.compile(..., options={"guard_filter_fn": guard_filter})``: which guards to keep (see above).

    Usage: ``torch.compile(model, options={"guard_filter_fn": domain.guard_filter})``
    """
    return [not _dropped(entry) for entry in entries]
