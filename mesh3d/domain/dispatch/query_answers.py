"""Metadata and size queries on domain tensors, answered before any dispatch: they plan nothing and move nothing.

``DomainTensor.__torch_function__`` looks the called function up in its class's ``_queries`` first; a handler returns
the answer, or ``NotImplemented`` where the dispatcher must answer:

* metadata queries (``.dtype``, ``.device``, ``dim()`` ...): answered from the shard, as the dispatcher does (not
  ``.grad``, which the dispatcher lays out as the whole tensor: ``dispatch.grads``; nor a wrapper's ``data_ptr()``,
  which the dispatcher refuses, naming what to call instead);
* size queries (``.shape``, ``size()``, ``numel()`` ...): the whole tensor's answer, as the dispatcher gives it
  (while torch.compile fakifies an input it asks for the shard's: the dispatcher's).

Usage (``mesh3d.domain`` installs them)::

    DomainTensor._queries = QUERIES; WrappedDomainTensor._queries = WRAPPED_QUERIES
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_compiling

from mesh3d._torch_private import disable_torch_function_subclass
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.wrapped import WrappedDomainTensor
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.queries import GLOBAL_SIZES, METADATA, global_size_answer

__all__ = ["QUERIES", "WRAPPED_QUERIES"]


def _metadata(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    with disable_torch_function_subclass():
        return func(*args, **(kwargs or {}))


def _global_size(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    if not args or type(args[0]) is not DomainTensor or is_compiling():
        return NotImplemented  # NOTE: torch.compile fakifying an input asks for the shard's sizes: the dispatcher's
    return global_size_answer(func, args[0], args[1:], kwargs or {})


def _global_size_wrapped(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    if not args or type(args[0]) is not WrappedDomainTensor or is_compiling():
        return NotImplemented
    return global_size_answer(func, args[0], args[1:], kwargs or {})


#: Function -> its handler, for storage domain tensors (``DomainTensor._queries``).
QUERIES: dict[Callable, Callable[[Callable, tuple, dict | None], Any]] = {
    **{f: _metadata for f in METADATA if f not in GRADIENT_CALLS}, **{f: _global_size for f in GLOBAL_SIZES}}
#: The same for wrapper tensors (``WrappedDomainTensor._queries``).
WRAPPED_QUERIES: dict[Callable, Callable[[Callable, tuple, dict | None], Any]] = {
    **{f: _metadata for f in METADATA if f not in GRADIENT_CALLS and f is not torch.Tensor.data_ptr},
    **{f: _global_size_wrapped for f in GLOBAL_SIZES}}
