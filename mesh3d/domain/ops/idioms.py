"""Model idioms on domain tensors: indexing, class tokens, embeddings, unsqueeze/expand/unflatten, chunk.

Usage: automatic, through torch::

    cls = x[:, 0]                         # one position of the sharded dim: a replicated value
    x = torch.cat([cls_token, x], dim=1)  # rows go to the rank owning that position (layout uneven)
    x = x[:, 1:]                          # slices (any positive step) keep the sharding
    e = F.embedding(ids_s, weight)        # ids sharded: the result is sharded like them
    pos = domain.positions(xs)            # global positions of this rank's rows (no O(global) arange on any rank)

Every rule decides from the global layout (``spec.sizes``), so every rank takes the same path and
raises the same error.
"""

from __future__ import annotations

import math
import os
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d.domain.dispatch.dispatcher import redispatch, run_step
from mesh3d.domain.ops.pieces import cat_pieces, index_rows
from mesh3d.domain.ops.reshape import reshaped, target_shape
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.kept_steps import metadata_rule
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.dispatch.step import Entering, OwnRows, Step, whole_operand
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap, wrap

__all__ = ["cat_along_sharded", "expand_index", "index_without_tensors", "positions", "replicated_slice", "slice_sizes"]


def positions(x: DomainTensor, dim: int | None = None) -> DomainTensor:
    """Global indices of this rank's rows along the sharded dim, as a 1-D int64 domain tensor sharded like them.

    Usage: ``pos = domain.positions(xs); xs + pos_embedding(pos)``

    ``torch.arange(x.shape[1])`` is right too (sizes are global; it is sliced where it meets ``x``), but holds every
    position on every rank; this holds this rank's only.
    """
    spec = x.spec
    if spec.dim is None:
        raise ValueError("domain.positions: x is replicated (not sharded); torch.arange(x.shape[d]) is global there")
    if dim is not None and dim % x.ndim != spec.dim:
        raise ValueError(f"domain.positions: dim {dim} is not the sharded dim {spec.dim}; torch.arange is right there")
    n = spec.sizes[spec.comm.index]
    return wrap(torch.arange(spec.offset, spec.offset + n, device=unwrap(x).device), DomainSpec(0, spec.sizes, spec.comm, 1))


# ----------------------------------------------------------------------------- indexing
def slice_sizes(sizes: Sequence[int], start: int, stop: int, step: int) -> list[tuple[int, int, int]]:
    """Per rank: (local start, local stop, count) of ``range(start, stop, step)`` within its rows."""
    out = []
    for off, n in zip(offsets_of(sizes), sizes):
        lo, hi = max(start, off), min(stop, off + n)
        if lo < hi:
            first = lo + (-(lo - start)) % step
            count = max(0, -(-(hi - first) // step))
        else:
            first, count = lo, 0
        out.append((first - off, first - off + (count - 1) * step + 1 if count else first - off, count))
    return out


def expand_index(index, ndim: int) -> list:
    items = list(index) if isinstance(index, tuple) else [index]
    used = sum(1 for i in items if i is not None and i is not Ellipsis
               and not (isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.ndim > 1))
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (ndim - used)
    return items + [slice(None)] * (ndim - sum(1 for i in items if i is not None))


def index_without_tensors(x: Any, index: Any) -> bool:
    """Whether an index reads no tensor's values (ints, slices, None, Ellipsis): its rule plans from metadata."""
    items = index if isinstance(index, tuple) else (index,)
    return not any(isinstance(i, (torch.Tensor, list)) for i in items)


@register(torch.Tensor.__getitem__)
@metadata_rule(when=index_without_tensors)
def _getitem(x: DomainTensor, index):
    if not isinstance(x, DomainTensor) or x.spec.dim is None:
        raise NotImplementedError(
            "indexing with a domain-sharded index tensor is not supported; index with plain tensors or use "
            "F.embedding for lookups")
    spec = x.spec
    items = expand_index(index, x.ndim)
    in_dim = out_dim = 0
    new_dim = None
    take_one = None
    for i, item in enumerate(items):
        if item is None:
            out_dim += 1
            continue
        if in_dim == spec.dim:
            n = sum(spec.sizes)
            if isinstance(item, int) or (isinstance(item, torch.Tensor) and item.ndim == 0 and not item.is_floating_point()
                                         and item.dtype != torch.bool):
                pos = int(item)
                pos = pos + n if pos < 0 else pos
                if not 0 <= pos < n:
                    raise IndexError(f"index {int(item)} is out of range for the sharded dim {spec.dim} of length {n}")
                items[i], take_one, new_dim = slice(pos, pos + 1), out_dim, out_dim
            elif isinstance(item, slice):
                start, stop, step = item.indices(n)
                if step <= 0:
                    raise NotImplementedError("a slice with a negative step along the sharded dim is not supported")
                new_dim = out_dim
            elif isinstance(item, (torch.Tensor, list)) and sum(
                    isinstance(j, (torch.Tensor, list)) for j in items) == 1:  # x[..., idx, :]: ops/pieces.py
                picked = run_step(index_rows(x, spec.dim, torch.as_tensor(item)))
                return redispatch(torch.Tensor.__getitem__, picked, tuple(slice(None) if j is item else j for j in items))
            else:
                raise NotImplementedError(
                    f"torch.Tensor.__getitem__ with a {type(item).__name__} index along the sharded dim {spec.dim} "
                    "is not supported with another tensor index (ints, slices and one 1-D index tensor are); call "
                    ".full_tensor() first"
                )
        elif not isinstance(item, (int, slice)):
            if sum(not isinstance(j, (int, slice)) and j is not None for j in items) > 1 or (
                    isinstance(item, torch.Tensor) and item.dtype == torch.bool and item.ndim != 1):
                raise NotImplementedError(
                    "torch.Tensor.__getitem__ on a domain tensor supports one 1-D tensor/list index on a non-sharded dim;"
                    " for a boolean mask over the tensor (x[mask]) use torch.where(mask, x, 0), or for a masked loss "
                    "((x - y) ** 2 * mask).sum() / mask.sum()")
        in_dim += 1
        if not isinstance(item, int):
            out_dim += 1
    n = sum(spec.sizes)
    item = items[_item_of(items, spec.dim)]
    start, stop, step = item.indices(n)
    per_rank = slice_sizes(spec.sizes, start, stop, step)
    lo, hi, _ = per_rank[spec.comm.index]
    local_items = list(items)
    local_items[_item_of(items, spec.dim)] = slice(lo, hi, step)
    key = tuple(local_items)
    step_ = Step(lambda t: t[key], (x,), out=spec.with_sizes(tuple(c for _, _, c in per_rank), dim=new_dim))
    if take_one is None:
        return step_
    one = run_step(step_)  # global length 1: replicated now; drop the indexed dim as the int index does
    return redispatch(torch.Tensor.select, one, take_one, 0)


def _item_of(items: list, dim: int) -> int:
    """Position in ``items`` of the index applying to input dim ``dim``."""
    seen = -1
    for i, item in enumerate(items):
        if item is not None:
            seen += 1
            if seen == dim:
                return i
    raise AssertionError(dim)


# ----------------------------------------------------------------------------- cat along the sharded dim
def cat_along_sharded(tensors: Sequence, dim: int, ref: DomainTensor) -> Step:
    """``torch.cat`` along the sharded dim of ONE sharded tensor with plain/replicated ones.

    Usage: ``cat_along_sharded([cls, xs], 1, xs)`` (the ``torch.cat`` rule calls it)

    Whole pieces before the sharded one go to the rank owning its first row (after it: its last
    row), so concatenating the ranks' results in rank order is the one-process result. Ranks that
    do not own a piece still take a zero-row slice of it, so a replicated piece's gradient sum
    (``Entering``) runs on every rank.
    """
    spec = ref.spec
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DomainTensor) and t.spec.dim is not None]
    if len(sharded) != 1:  # several sharded pieces: their rows laid out anew (ops/pieces.py)
        return cat_pieces(list(tensors), dim, ref)
    at = sharded[0]
    holders = [r for r, s in enumerate(spec.sizes) if s]
    first, last = (holders[0], holders[-1]) if holders else (0, spec.comm.size - 1)
    me = spec.comm.index
    sizes = list(spec.sizes)
    reqs, owned = [], []
    for i, t in enumerate(tensors):
        if i == at:
            reqs.append(t)
            owned.append(True)
            continue
        owner = first if i < at else last
        sizes[owner] += t.shape[dim]
        reqs.append(Entering(t) if isinstance(t, DomainTensor) else t)
        owned.append(owner == me)

    def compute(*ts):
        return torch.cat([t if own else t.narrow(dim, 0, 0) for t, own in zip(ts, owned)], dim)

    return Step(compute, tuple(reqs), out=spec.with_sizes(tuple(sizes)),
                keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))


def replicated_slice(o: torch.Tensor, dim: int, ref: DomainTensor) -> OwnRows:
    """This rank's rows of ``o``, a plain or replicated tensor of the global length along the sharded dim, as a step's
    argument (``step.OwnRows``: the executor cuts them; a replicated value's gradient is summed over the domain).

    Usage: ``Step(torch.add, (xs, replicated_slice(pos_embed, 1, xs)), out=xs.spec)`` (the element-wise rule's)

    A plain tensor as large as the whole domain tensor is warned about once per line of user code: it costs O(global)
    memory on every rank, where ``xs.new_zeros(xs.shape)`` or ``torch.zeros_like(xs)`` hold this rank's rows only.
    """
    spec = ref.spec
    if not isinstance(o, DomainTensor) and spec.comm.size > 1 and o.numel() >= math.prod(size_of(ref)) > 0:
        _warn_whole_size(o, ref)
    return OwnRows(o, dim, spec)


def _warn_whole_size(o: torch.Tensor, ref: DomainTensor) -> None:
    frame = next((f for f in reversed(traceback.extract_stack()[:-2])
                  if not any(part in f.filename for part in (f"{os.sep}torch{os.sep}", f"{os.sep}mesh3d{os.sep}"))),
                 None)
    message = (f"a plain tensor of shape {tuple(o.shape)} meets a domain tensor of global shape {tuple(size_of(ref))}: it "
               f"holds the whole tensor on each of the {ref.spec.comm.size} domain ranks (O(global) memory each), of "
               "which each rank uses its rows; build it with x.new_zeros(x.shape) / torch.zeros_like(x) (or from "
               "domain.positions(x)) to hold this rank's rows only")
    if frame is None or frame.lineno is None:
        warnings.warn(message, ResourceWarning, stacklevel=3)
    else:  # the registry makes "default" mean once per line of user code, as warnings.warn does per call site
        warnings.warn_explicit(message, ResourceWarning, frame.filename, frame.lineno, module="mesh3d.domain",
                               registry=_WHOLE_SIZE_WARNINGS.setdefault(frame.filename, {}))


#: Per user file, the warnings registry of the whole-size warning (which lines have warned).
_WHOLE_SIZE_WARNINGS: dict[str, dict] = {}


# ----------------------------------------------------------------------------- embeddings and shape ops
@register(F.embedding)
def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False) -> Step:
    if max_norm is not None or scale_grad_by_freq:
        raise NotImplementedError(
            "F.embedding with max_norm or scale_grad_by_freq on sharded ids is not supported (both depend on "
            "which ids this rank sees); use max_norm=None, scale_grad_by_freq=False"
        )
    if not isinstance(input, DomainTensor) or input.spec.dim is None:
        raise NotImplementedError("F.embedding with a domain-sharded weight is not supported; shard the ids")
    return Step(lambda ids, w: F.embedding(ids, w, padding_idx, None, norm_type, False, sparse),
                (input, whole_operand(weight, "F.embedding")), out=input.spec)


def _shifted(x: DomainTensor, new_ndim: int) -> DomainSpec:
    return x.spec.with_sizes(x.spec.sizes, dim=x.spec.dim + new_ndim - x.ndim)


@register(torch.unsqueeze, torch.Tensor.unsqueeze)
@metadata_rule()
def _unsqueeze(input, dim) -> Step:
    d = dim % (input.ndim + 1)
    new = input.spec.dim + 1 if d <= input.spec.dim else input.spec.dim
    return Step(lambda t: t.unsqueeze(d), (input,), out=input.spec.with_sizes(input.spec.sizes, dim=new))


@register(torch.squeeze, torch.Tensor.squeeze)
@metadata_rule()
def _squeeze(input, dim=None) -> Step:
    local_shape = unwrap(input).shape
    dims = range(input.ndim) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    dims = sorted({d % input.ndim for d in dims if local_shape[d % input.ndim] == 1} - {input.spec.dim})
    new = input.spec.dim - sum(d < input.spec.dim for d in dims)
    return Step(lambda t: t.squeeze(tuple(dims)) if dims else t.view_as(t), (input,),
                out=input.spec.with_sizes(input.spec.sizes, dim=new))


@register(torch.Tensor.expand)
@metadata_rule()
def _expand(input, *sizes) -> Step:
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes
    spec = _shifted(input, len(sizes))
    length = sum(spec.sizes)
    if sizes[spec.dim] not in (-1, length):
        raise RuntimeError(
            f"torch.Tensor.expand{tuple(sizes)}: the expanded size ({sizes[spec.dim]}) must match the existing size "
            f"({length}) at the sharded dim {spec.dim}, as in one process; use -1 or {length} there"
        )
    local = tuple(-1 if i == spec.dim else n for i, n in enumerate(sizes))
    return Step(lambda t: t.expand(local), (input,), out=spec)


@register(torch.Tensor.expand_as)
@metadata_rule()
def _expand_as(input, other) -> Step:
    if isinstance(input, DomainTensor) and input.spec.dim is not None:
        return _expand(input, *size_of(other))
    # A replicated or plain value expanded to a sharded tensor's shape (a class token over every patch, DPT's
    # reassemble): this rank's part of the result, laid out as ``other``.
    spec = other.spec
    at = spec.dim - (other.ndim - input.ndim)
    if at >= 0 and size_of(input)[at] not in (1, sum(spec.sizes) * spec.outer):
        raise RuntimeError(
            f"torch.Tensor.expand_as: a tensor of shape {tuple(size_of(input))} cannot be expanded to "
            f"{tuple(size_of(other))} (size {size_of(input)[at]} at dim {at}, as in one process)")
    local = unwrap(other).shape
    if at >= 0 and size_of(input)[at] != 1:  # the global length there: this rank's rows of it
        rows = replicated_slice(input, at, other)
        return Step(lambda t: t.expand(local), (rows,), out=spec)
    return Step(lambda t: t.expand(local), (Entering(input) if isinstance(input, DomainTensor) else input,),
                out=spec, keep=(input,) if not isinstance(input, DomainTensor) else ())


@register(torch.unflatten, torch.Tensor.unflatten)
@metadata_rule()
def _unflatten(input, dim, sizes):
    shape = list(input.shape)
    d = dim % len(shape)
    inner = target_shape((tuple(sizes),), shape[d])
    return reshaped(input, [*shape[:d], *inner, *shape[d + 1:]], "torch.unflatten ->", view=False)


COMPLEX_PARTS = (getattr(torch.Tensor, "real").__get__, getattr(torch.Tensor, "imag").__get__, torch.real, torch.imag, torch.conj,
                  torch.Tensor.conj, torch.angle, torch.Tensor.angle, torch.view_as_real, torch.view_as_complex)


def _complex_rule(func):
    """Real/imaginary parts, conjugate, angle: element by element (``view_as_real`` adds a last dim)."""
    return lambda input: Step(func, (input,), out=input.spec)


for _f in COMPLEX_PARTS:
    register(_f)(_complex_rule(_f))
