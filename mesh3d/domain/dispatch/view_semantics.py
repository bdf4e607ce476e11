"""Whether a call returns a view of its input, decided as one process decides it: from the whole tensor's metadata.

Usage (the dispatcher, on each wrapper result; ``mesh3d.domain.dispatch.writes.record_views``)::

    answer = one_process(torch.Tensor.permute, (xs, 0, 3, 1, 2), {})   # answer.views == (True,): a view of xs

Why: a wrapper domain tensor that views another one replays its view ops when written into
(``mesh3d.domain.dispatch.writes``), and a write into it then journals ops its peers must journal alike. Whether the
shard a rule returned aliases the input's shard differs between ranks where the shards differ in kind: an empty shard
is contiguous and may view the tensor the user sharded, a shard of one row is contiguous where its peers' are not. So
each view function's answer is torch's own on meta tensors of the whole tensors' sizes and strides, the same on every
rank, cached per call signature.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mesh3d._torch_private import disable_torch_function_subclass, outside_dispatch_modes, outside_transforms

__all__ = ["VIEW_FUNCTIONS", "OneProcess", "one_process"]

#: What may return a view of (or the same tensor as) its first argument in torch: views, and the calls torch answers
#: with a view or ``self`` where the strides allow (``reshape``, ``contiguous``, ``to``, ``flatten`` ...).
_NAMES = (
    "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "swapaxes", "swapdims", "movedim",
    "moveaxis", "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select", "__getitem__", "unbind", "split",
    "split_with_sizes", "chunk", "tensor_split", "hsplit", "vsplit", "dsplit", "unflatten", "flatten", "diagonal",
    "unfold", "as_strided", "detach", "contiguous", "to", "type_as", "view_as_real", "view_as_complex", "adjoint",
    "alias", "ravel", "float", "double", "half", "bfloat16", "type", "conj", "resolve_conj", "resolve_neg",
    "int", "long", "short", "char", "byte", "bool", "cfloat", "cdouble", "cpu", "cuda", "to_dense", "positive",
    "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors", "meshgrid", "__iter__",
    "unsafe_split", "unsafe_chunk", "split_with_sizes", "requires_grad_", "as_subclass",
)
_PROPERTIES = ("T", "mT", "H", "mH", "real", "imag")


def _functions() -> frozenset:
    found: set = set()
    for name in _NAMES:
        for owner in (torch.Tensor, torch):
            f = getattr(owner, name, None)
            if callable(f):
                found.add(f)
    for name in _PROPERTIES:
        found.add(getattr(torch.Tensor, name).__get__)
    for name in ("real", "imag"):
        found.add(getattr(torch, name))
    found.add(getattr(torch.Tensor, "data").__get__)  # NOTE: x.data shares x's memory
    return frozenset(found)


#: The functions whose results' view-ness is decided here; every other call keeps what its shard says.
VIEW_FUNCTIONS = _functions()

#: The view functions whose success depends on the strides: one process raises where the whole tensor's strides do not
#: allow the call, whatever a rank's shard allows (a shard of one row is contiguous where its peers' are not)
_RAISING = frozenset({torch.Tensor.view, torch.Tensor.view_as})


class OneProcess(NamedTuple):
    """What torch's call on the whole tensors answers (meta tensors of their sizes, strides and storage offsets)."""

    #: Per tensor of the result: a view of an input (True), memory of its own (False), the input itself or its memory
    #: shared without being a view (None: ``detach()``)
    views: tuple[bool | None, ...]
    #: Per tensor of the result: its strides and storage offset in one process (None: not a tensor)
    layouts: tuple[tuple[tuple[int, ...], int] | None, ...]
    #: What one process raises (``view`` of strides that do not allow it: torch's message), else None
    error: str | None = None
    #: Per tensor of the result: its sizes (None: not a tensor)
    shapes: tuple[tuple[int, ...] | None, ...] = ()


_CACHE: dict[tuple, OneProcess | None] = {}
_CACHE_SIZE = 4096
_MISSING = object()


def one_process(func: Callable, args: tuple, kwargs: dict) -> OneProcess | None:
    """For ``func`` in ``VIEW_FUNCTIONS``: torch's answer on the whole tensors (``OneProcess``); None where no meta run
    answers (a data-dependent call, such as a boolean mask's index: never a view in torch).

    Usage: ``answer = one_process(torch.Tensor.permute, (xs, 0, 3, 1, 2), {})   # answer.views == (True,)``
    """
    key = (func, _signature(args), _signature(tuple(kwargs.items())) if kwargs else ())
    try:
        hit = _CACHE.get(key, _MISSING)
    except TypeError:  # an argument that does not hash (a list): answered without the cache
        return _answer(func, args, kwargs)
    if hit is _MISSING:
        hit = _answer(func, args, kwargs)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = hit
    return hit


def _signature(values: tuple) -> tuple:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            with disable_torch_function_subclass():  # NOTE: a wrapper's own sizes and strides are the whole tensor's
                out.append(("tensor", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype))
        elif isinstance(v, tuple):
            out.append(_signature(v))
        elif type(v) is slice:  # NOTE: a slice does not hash before Python 3.12: x[:, 1] was a meta run per call
            out.append((slice, v.start, v.stop, v.step))
        else:
            out.append(v)
    return tuple(out)


def _meta(v: Any, device: torch.device) -> Any:
    """``v`` with tensors as meta tensors of their own (whole) sizes, strides and storage offsets, and the tensors'
    device as meta's (a move to another device stays one: a copy, as torch's)."""
    if isinstance(v, torch.Tensor):
        with disable_torch_function_subclass():
            shape, strides, offset = tuple(v.shape), v.stride(), v.storage_offset()
            if not offset:
                return torch.empty_strided(shape, strides, dtype=v.dtype, device="meta")
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if 0 not in shape else 0
            return torch.empty(offset + extent, dtype=v.dtype, device="meta").as_strided(shape, strides, offset)
    if isinstance(v, (tuple, list)):
        return type(v)(_meta(i, device) for i in v)
    if isinstance(v, (str, torch.device)):
        try:
            return torch.device("meta") if torch.device(v) == device else v
        except (RuntimeError, TypeError):  # not a device's name (a dtype's, in x.type("torch.DoubleTensor"))
            return v
    return v


def _answer(func: Callable, args: tuple, kwargs: dict) -> OneProcess | None:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    device = first.device if first is not None else torch.device("cpu")
    # NOTE: outside the dispatch modes in force: a question about metadata, not part of the step (mesh3d plan's memory
    # tracker counted these whole-sized meta tensors as the first simulated rank's activations: 98 GiB of a 5 GiB step)
    with outside_dispatch_modes(), outside_transforms():
        metas = _meta(args, device)
        kw = {k: _meta(v, device) for k, v in kwargs.items()}
        try:
            with disable_torch_function_subclass(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # NOTE: the call's own warnings are the rule's to give (padding='same')
                out = func(*metas, **kw)
        except RuntimeError as error:
            # NOTE: a view the whole tensor's strides do not allow: torch's error, raised on every rank before the rule
            return OneProcess((), (), str(error)) if func in _RAISING else None
        except Exception:  # noqa: BLE001 - a call meta tensors cannot answer: no view decided here
            return None
    inputs = [m for m in metas if isinstance(m, torch.Tensor)]
    items = out if isinstance(out, (tuple, list)) else (out,)
    return OneProcess(tuple(_viewing(o, inputs) for o in items), tuple(_layout(o) for o in items), None,
                      tuple(tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in items))


def _layout(out: Any) -> tuple[tuple[int, ...], int] | None:
    return (out.stride(), out.storage_offset()) if isinstance(out, torch.Tensor) else None


def _viewing(out: Any, inputs: list) -> bool | None:
    """True: a view of an input; False: memory of its own; None: the input itself, or its memory shared without being
    a view (``detach()``): left to what the shard says."""
    if not isinstance(out, torch.Tensor):
        return False
    if any(out is m for m in inputs):  # NOTE: first: an input with a storage offset is itself a view here (``_meta``)
        return None
    if out._base is not None:
        return True
    storage = out.untyped_storage()._cdata
    return None if any(m.untyped_storage()._cdata == storage for m in inputs) else False
