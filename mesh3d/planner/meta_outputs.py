"""Outputs of functional aten ops on meta tensors, computed once per input signature.

On the meta device an op only computes its output's shape, strides and dtype, and many ops (``mul``, ``add``,
``cat``, ``pow``...) do it in Python through ``torch._refs``: about 130 us each on this CPU, most of a plan's
time. Those outputs depend on nothing but the inputs' metadata and the other arguments, so a simulated step,
which runs the same layer's ops for every layer and every simulated rank, can reuse them.

Usage::

    outputs = MetaOutputs()
    out = outputs.call(func, args, kwargs)    # inside a TorchDispatchMode, for any op: cached where it is safe
"""

from __future__ import annotations

from typing import Any

import torch
from mesh3d._torch_private import OpOverload, op_schema, storage_key

__all__ = ["MetaOutputs", "storages_of"]

_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _pure(func: OpOverload) -> bool:
    """One fresh tensor out, nothing written, no alias: the output is a function of the arguments' metadata."""
    schema = op_schema(func)
    if len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor" or schema.returns[0].alias_info is not None:
        return False
    if any(a.alias_info is not None for a in schema.arguments):
        return False
    return not func.is_view and torch.Tag.nondeterministic_seeded not in func.tags


def _key_of(x: Any) -> Any:
    """A hashable description of an argument: tensors by metadata (meta only), else the value; None: uncacheable."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta" or x.layout != torch.strided or x.is_complex():
            raise _Uncacheable
        return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_key_of(v) for v in x))
    if isinstance(x, _LEAVES):
        return (type(x).__name__, x)
    raise _Uncacheable


def storages_of(obj: object) -> list[torch.UntypedStorage]:
    """The storages of every tensor in nested tuples, lists and dicts (an op's arguments or results).

    NOTE: not ``torch.utils._pytree.tree_flatten``: this runs for every op of the simulated step, and pytree's
    generality cost a third of a plan's time."""
    out, stack = [], [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x.untyped_storage())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


class _Uncacheable(Exception):
    pass


class MetaOutputs:
    """Memoized output metadata of pure ops on meta tensors (see the module docstring)."""

    def __init__(self) -> None:
        self._pure: dict[OpOverload, bool] = {}
        self._outputs: dict[tuple, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = {}

    def call(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``, or an empty meta tensor of the output's metadata when it was seen before."""
        pure = self._pure.get(func)
        if pure is None:
            pure = self._pure[func] = _pure(func)
        if not pure:
            return func(*args, **kwargs)
        try:
            key = (func, _key_of(args), _key_of(tuple(sorted(kwargs.items()))))
        except _Uncacheable:
            return func(*args, **kwargs)
        known = self._outputs.get(key)
        if known is not None:
            return torch.empty_strided(known[0], known[1], dtype=known[2], device="meta")
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta" and out.storage_offset() == 0:
            if storage_key(out.untyped_storage()) in {storage_key(s) for s in storages_of((args, kwargs))}:
                # NOTE: an op whose schema promises a fresh tensor can still return its input's storage
                # (``aten._unsafe_view`` after ``linear``'s matmul): a cached fresh tensor would count bytes the op
                # never allocates, on every call after the first
                self._pure[func] = False
            else:
                self._outputs[key] = (tuple(out.shape), out.stride(), out.dtype)
        return out
