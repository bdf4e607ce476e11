"""The groups of torch functions the domain dispatcher answers itself: metadata, global sizes, data queries.

Usage::

    from mesh3d.domain.dispatch.queries import is_global_size, is_metadata
    if is_metadata(func): ...      # answered from the local shard
    if is_global_size(func): ...   # answered for the whole tensor

NOTE: torch 2.11's Dynamo cannot hash a getset descriptor or a method-wrapper (``Tensor.dtype.__get__``), so it
cannot trace ``func in METADATA``. There, while Dynamo traces, ``is_metadata`` and ``is_global_size`` compare
``func`` with each member in turn (a trace-time cost only). torch 2.13 traces the set lookup itself, and the test
suite runs on 2.13; the fallback is what lets the same code compile on the older torch of a GPU image.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.compiler import is_dynamo_compiling
import math
from typing import Any
from mesh3d.domain.core.tensor import DomainTensor, global_shape_of, global_strides_for, is_wrapper

__all__ = ["DATA_GET", "DATA_QUERIES", "GLOBAL_SIZES", "METADATA", "NBYTES_GET", "SHAPE_GET", "is_global_size",
           "is_metadata"]

# Queries answered from the local shard: they hold no size and no tensor data to get wrong.
_LOCAL_METADATA_NAMES = (
    "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "layout", "grad",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_version", "output_nr", "_base", "is_nested",
    # autograd bookkeeping that torch itself reads and writes during in-place ops and hook registration
    "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "_grad", "_grad_fn", "is_cpu",
    # introspection by torch.compile, FSDP and the autograd engine: must never raise (compile_anchors.md)
    "_is_view", "is_inference", "is_shared", "is_pinned", "is_conj", "is_neg", "_is_zerotensor", "itemsize",
    "is_mps", "is_xpu", "is_mkldnn", "is_vulkan", "is_ipu", "is_sparse_csr", "has_names", "_python_dispatch",
    "grad_dtype",  # the dtype .grad takes (torch 2.13; Dynamo reads it for an input that requires grad)
)
METADATA: set = set()
for _name in _LOCAL_METADATA_NAMES:
    _attr = getattr(torch.Tensor, _name, None)
    if _attr is None:
        continue
    if inspect.isdatadescriptor(_attr):  # a property such as .dtype: its getter (and setter) is what torch passes
        METADATA.add(_attr.__get__)
        if hasattr(_attr, "__set__"):
            METADATA.add(_attr.__set__)
    else:
        METADATA.add(_attr)
METADATA.update(
    getattr(torch.Tensor, n)
    for n in (
        "dim", "is_contiguous", "element_size", "data_ptr", "is_floating_point", "is_complex",
        "backward", "retain_grad", "register_hook", "get_device", "__hash__", "__format__", "storage_offset",
        "requires_grad_", "untyped_storage", "__reduce_ex__", "__setstate__", "is_signed",
        "register_post_accumulate_grad_hook", "_is_view", "is_set_to", "nbytes",
    )
    if hasattr(torch.Tensor, n)
)
# Their function forms too: FSDP's mixed precision asks torch.is_floating_point(x) of every input.
METADATA.update((torch.is_floating_point, torch.is_complex))

#: Size queries: answered for the whole tensor, as DTensor does (``x.shape`` is the one-process shape).
GLOBAL_SIZES = {torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement,  # type: ignore[attr-defined]
                torch.Tensor.__len__, torch.Tensor.stride, torch.numel, torch.Tensor.nbytes.__get__}  # type: ignore[attr-defined]


SHAPE_GET = torch.Tensor.shape.__get__  # type: ignore[attr-defined]
NBYTES_GET = torch.Tensor.nbytes.__get__  # type: ignore[attr-defined]
#: ``x.data``: a detached alias of the shard, still a domain tensor (its sizes stay global).
DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]
#: Queries answered by the dispatcher itself besides METADATA and GLOBAL_SIZES.
DATA_QUERIES = {DATA_GET}


_METADATA_LISTED = tuple(METADATA)
_GLOBAL_SIZES_LISTED = tuple(GLOBAL_SIZES)


def _equal_to_any(func: Callable, members: tuple) -> bool:
    for member in members:
        if func is member or func == member:
            return True
    return False


if torch.__version__ >= (2, 13):  # NOTE: TorchVersion compares with tuples
    def is_metadata(func: Callable) -> bool:
        """``func`` is a query answered from the local shard. Usage: ``if is_metadata(func): ...``"""
        return func in METADATA

    def is_global_size(func: Callable) -> bool:
        """``func`` is a size query answered for the whole tensor. Usage: ``if is_global_size(func): ...``"""
        return func in GLOBAL_SIZES
else:
    def is_metadata(func: Callable) -> bool:
        """``func`` is a query answered from the local shard. Usage: ``if is_metadata(func): ...``"""
        if is_dynamo_compiling():
            return _equal_to_any(func, _METADATA_LISTED)
        return func in METADATA

    def is_global_size(func: Callable) -> bool:
        """``func`` is a size query answered for the whole tensor. Usage: ``if is_global_size(func): ...``"""
        if is_dynamo_compiling():
            return _equal_to_any(func, _GLOBAL_SIZES_LISTED)
        return func in GLOBAL_SIZES


def global_size_answer(func: Callable, x: DomainTensor, rest: tuple, kwargs: dict) -> Any:
    """``func``'s answer (a size query) for the whole tensor ``x`` stands for."""
    whole = global_shape_of(x)
    if func == SHAPE_GET:  # NOTE: ==, not is: each access to a slot's __get__ makes a new method-wrapper
        return whole
    if func in (torch.Tensor.numel, torch.Tensor.nelement, torch.numel):
        return math.prod(whole)
    if func == NBYTES_GET:
        return math.prod(whole) * x.element_size()
    if func is torch.Tensor.__len__:
        if not whole:
            raise TypeError("len() of a 0-d tensor")
        return whole[0]
    dim = rest[0] if rest else kwargs.get("dim")
    if func is torch.Tensor.stride:
        strides = global_strides(x, whole)
        return strides if dim is None else strides[dim]
    return whole if dim is None else whole[dim]  # size()


def global_strides(x: DomainTensor, whole: torch.Size) -> tuple[int, ...]:
    """Strides of the whole tensor: a wrapper tensor's own (a view's are the one-process view's, ``core.relayout``),
    else laid out in the shard's memory order (``tensor.global_strides_for``)."""
    if is_wrapper(x):
        return x._strides  # type: ignore[attr-defined]  # a wrapper's own
    return global_strides_for(x, whole)
