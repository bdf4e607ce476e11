"""A call's signature on wrapper tensors: what ``dispatch.kept`` keeps a rule's answer under.

Usage::

    try:
        key = signature(func, args, kwargs, grids)     # a flat, hashable tuple
    except Unkept:
        ...                                            # an argument no kept answer covers: the dispatcher's

What a signature holds is listed in ``dispatch.kept``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d.domain.core.specs import DomainSpec, Layout
from mesh3d.domain.core.wrapped import WrappedDomainTensor

__all__ = ["ONE_RANK_GRAPHS", "PLAIN", "Unkept", "signature"]

#: Among a function's kept grids: graph tensors on a one-rank domain are keyed too (``dispatch.kept``)
ONE_RANK_GRAPHS = "graphs on one rank"
#: Plain tensor types, keyed by their metadata
PLAIN = (torch.Tensor, torch.nn.Parameter)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class Unkept(Exception):
    """An argument or result outside what a kept layout covers."""


def signature(func: Callable, args: tuple, kwargs: dict, grids: frozenset) -> tuple:
    """The call's signature (what ``dispatch.kept``'s docstring lists), as one flat tuple: each argument's kind
    first, so no two calls' arguments give the same items (a sequence's length, each keyword's name after a marker,
    are among them); ``Unkept`` for a grid layout (blocks, a token grid) not among ``grids``.

    Usage: ``key = signature(torch.relu, (xs,), {}, frozenset())``
    """
    key: list = [func, torch.is_grad_enabled()]
    for v in args:
        _part(v, key, grids)
    if kwargs:
        if "out" in kwargs:
            raise Unkept
        for k, v in kwargs.items():
            key.append(_KEYWORD)
            key.append(k)
            _part(v, key, grids)
    return tuple(key)


#: What stands before a keyword argument's name in a signature
_KEYWORD = object()


def _part(v: Any, key: list, grids: frozenset) -> None:
    kind = type(v)
    if kind is WrappedDomainTensor:
        spec = v._spec
        if type(spec) is not DomainSpec and spec.layout not in grids and \
                (ONE_RANK_GRAPHS not in grids or spec.layout is not Layout.GRAPH or spec.comm.size != 1):
            raise Unkept  # NOTE: blocks and token grids where their rule may be kept; graphs on one rank
        local = v._local
        key += (kind, spec, local.shape, local.stride(), v._strides, v._offset, local.dtype, v.requires_grad)
    elif kind in PLAIN:
        key += (kind, v.shape, v.stride(), v.dtype, v.device, v.requires_grad)
    elif kind in _VALUES:
        key += (kind, v)  # NOTE: the type too: 1, 1.0 and True are one key otherwise
    elif kind is tuple or kind is list:
        key += (kind, len(v))
        for x in v:
            _part(x, key, grids)
    elif kind is slice:  # NOTE: an index; a slice does not hash before Python 3.12
        key.append(kind)
        _part(v.start, key, grids)
        _part(v.stop, key, grids)
        _part(v.step, key, grids)
    elif v is Ellipsis:
        key.append(v)
    else:
        raise Unkept
