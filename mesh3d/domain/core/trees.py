"""Mapping over nested arguments: lists, tuples and dicts of tensors and other leaves.

Usage: ``tree_map(unwrap, (args, kwargs))``, ``flat_tensors((args, kwargs))``

NOTE: not ``torch.utils._pytree`` (private): an op's arguments nest one or two levels of plain containers, and a
named tuple (``torch.return_types``) is a leaf here, as rules expect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["flat_tensors", "tree_map"]


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf of nested lists/tuples/dicts.

    Usage: ``tree_map(unwrap, (args, kwargs))``
    """
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return fn(obj)


def flat_tensors(obj: Any) -> list:
    """Every tensor leaf of nested lists/tuples/dicts, in order.

    Usage: ``flat_tensors((args, kwargs))``
    """
    out: list = []
    tree_map(lambda o: out.append(o) if isinstance(o, torch.Tensor) else None, obj)
    return out
