"""Ops that take global indices along the sharded dim: roll, flip, narrow, select, split/chunk/unbind, setitem.

Usage: automatic, through torch; every index and size is the one-process one::

    xs.roll(3, dims=2); xs.flip(2)           # rows cross rank boundaries: fetched from their owners
    a, b = xs.split([5, 7], dim=2)           # pieces sharded over the ranks that hold their rows
    edge = xs.select(2, -1)                  # one position: a replicated value
    xs[:, :, 0] = 0.0                        # a boundary row: written on the rank that owns it

Each rule decides from the global layout (``spec.sizes``), so every rank takes the same path; rows that
move travel through the exchange (``Rows``), so the backward is the exact adjoint.
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d.domain.dispatch.dispatcher import redispatch
from mesh3d.domain.layouts.slabs import redistribute_local
from mesh3d.domain.ops.idioms import slice_sizes
from mesh3d.domain.dispatch.registry import BLOCK_RULES, TOKEN_RULES, op_name, register
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.core.specs import DomainSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap

__all__ = ["flipped_dims", "mirrored_rows", "piece", "rolled_rows", "setitem"]


def _dims(dims, ndim: int) -> list[int]:
    return [d % ndim for d in ((dims,) if isinstance(dims, int) else dims)]


def rolled_rows(offset: int, count: int, shift: int, n: int) -> tuple[Span, ...]:
    """Global source rows of output rows [offset, offset + count) of a roll by ``shift``: at most two runs."""
    if count == 0:
        return ()
    start = (offset - shift) % n
    if start + count <= n:
        return (Span.rows(start, start + count),)
    return Span.rows(start, n), Span.rows(0, start + count - n)


def _roll(input, shifts, dims=None) -> Step:
    if dims is None:
        raise NotImplementedError(
            "torch.roll without dims= flattens the tensor, mixing the sharded dim with the others; give dims= "
            "(every dim you roll), or call .full_tensor() first")
    shifts_t = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims_t = _dims(dims, input.ndim)
    if len(shifts_t) != len(dims_t):
        raise RuntimeError(f"torch.roll: shifts and dims must align (got shifts={shifts!r}, dims={dims!r})")
    spec = input.spec
    others = [(s, d) for s, d in zip(shifts_t, dims_t) if d != spec.dim]
    along = sum(s for s, d in zip(shifts_t, dims_t) if d == spec.dim)
    n = sum(spec.sizes)

    def roll_others(t):
        return torch.roll(t, [s for s, _ in others], [d for _, d in others]) if others else t

    if along % max(n, 1) == 0:
        return Step(roll_others, (input,), out=spec)
    needs = tuple(rolled_rows(o, c, along, n) for o, c in zip(offsets_of(spec.sizes), spec.sizes))
    return Step(roll_others, (Rows(input, needs),), out=spec)


def flipped_dims(dims: tuple, kwargs: dict, ndim: int) -> list[int]:
    """The dims of ``torch.flip(x, dims=...)``, ``x.flip(2, 3)`` or ``x.flip([2, 3])``, non-negative."""
    dims = kwargs.pop("dims", dims)
    return _dims(dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims, ndim)


def mirrored_rows(sizes: tuple[int, ...]) -> tuple[tuple[Span, ...], ...]:
    """Each rank's global source rows of a flip along a dim laid out as ``sizes`` (the mirror image of its own)."""
    n = sum(sizes)
    return tuple((Span.rows(n - o - c, n - o),) if c else () for o, c in zip(offsets_of(sizes), sizes))


def _flip(input, *dims, **kwargs) -> Step:
    flipped = flipped_dims(dims, kwargs, input.ndim)
    spec = input.spec
    if spec.dim not in flipped:
        return Step(lambda t: torch.flip(t, flipped), (input,), out=spec)
    return Step(lambda t: torch.flip(t, flipped), (Rows(input, mirrored_rows(spec.sizes)),), out=spec)


for _f in (torch.roll, torch.Tensor.roll):
    register(_f)(_roll)
for _f in (torch.flip, torch.Tensor.flip):
    register(_f)(_flip)
register(torch.fliplr, torch.Tensor.fliplr)(lambda input: _flip(input, [1]))
register(torch.flipud, torch.Tensor.flipud)(lambda input: _flip(input, [0]))


# ----------------------------------------------------------------------------- pieces along the sharded dim
def piece(x: DomainTensor, dim: int, start: int, stop: int) -> DomainTensor:
    """Global rows [start, stop) of ``x`` along ``dim`` (any dim): ``x[..., start:stop, ...]``.

    Usage: ``left = piece(xs, 2, 0, 5)``
    """
    index = (slice(None),) * dim + (slice(start, stop),)
    return redispatch(torch.Tensor.__getitem__, x, index)


def _bounds(length: int, sections: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in sections:
        out.append((at, at + s))
        at += s
    if at != length:
        raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to {length} (the global length of "
                           f"the dim), but got split_sizes={sections}")
    return out


def _split_sections(n: int, split_size_or_sections) -> list[int]:
    """``torch.split``'s pieces of a dim of global length ``n``."""
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        return [min(size, n - a) for a in range(0, n, size)] if n else [0]
    return list(split_size_or_sections)


def _chunk_sections(n: int, chunks: int) -> list[int]:
    """``torch.chunk``'s pieces (its own rule for the boundaries)."""
    return [len(c) for c in torch.arange(n).chunk(chunks)]


def _pieces_rule(func, sections):
    """``split``/``chunk``: along the sharded dim, pieces sharded over the ranks that hold their rows; else local."""
    def rule(input, how, dim=0):
        d = dim % input.ndim
        if d != input.spec.dim:
            return Step(lambda t: func(t, how, d), (input,), out=input.spec)
        n = size_of(input)[d]
        return tuple(piece(input, d, a, b) for a, b in _bounds(n, sections(n, how)))

    return rule


for _f in (torch.split, torch.Tensor.split):
    register(_f)(_pieces_rule(_f, _split_sections))
for _f in (torch.chunk, torch.Tensor.chunk):
    register(_f)(_pieces_rule(_f, _chunk_sections))


@register(torch.unbind, torch.Tensor.unbind)
def _unbind(input, dim=0):
    d = dim % input.ndim
    if d != input.spec.dim:
        spec = input.spec
        new = spec.dim - (d < spec.dim)
        return Step(lambda t: t.unbind(d), (input,), out=spec.with_sizes(spec.sizes, dim=new))
    return tuple([redispatch(torch.Tensor.select, input, d, i) for i in range(size_of(input)[d])])


@register(torch.narrow, torch.Tensor.narrow)
def _narrow(input, dim, start, length):
    d = dim % input.ndim
    n = size_of(input)[d]
    start = int(start) + (n if int(start) < 0 else 0)
    if not 0 <= start <= n or length < 0 or start + length > n:
        raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension size ({n}) of dim {d}")
    return piece(input, d, start, start + length)


@register(torch.select, torch.Tensor.select)
def _select(input, dim, index):
    d = dim % input.ndim
    return redispatch(torch.Tensor.__getitem__, input, (slice(None),) * d + (index,))


# ----------------------------------------------------------------------------- factories
def _requested(size: tuple):
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)


def _factory_rule(func, takes_fill: bool):
    """``x.new_zeros(shape)`` (and ones/empty/full): this rank's rows when ``shape`` is ``x``'s along the sharded dim.

    A shape with ``x``'s global length at ``x``'s sharded dim makes a domain tensor laid out like ``x`` (this rank's
    rows only: no O(global) memory); any other shape is a plain tensor of that shape, as in one process.
    """
    def rule(input, *args, **kwargs):
        if takes_fill:
            size, fill, rest = _requested(args[:1]), args[1] if len(args) > 1 else kwargs.pop("fill_value"), ()
        else:
            size, fill, rest = _requested(args), None, ()
        spec = input.spec
        whole = size_of(input)
        if len(size) == len(whole) and size[spec.dim] == whole[spec.dim]:
            local = list(size)
            local[spec.dim] = spec.sizes[spec.comm.index]
            extra = (fill,) if takes_fill else ()
            return Step(lambda t: func(t, local, *extra, *rest, **kwargs), (input,), out=spec)
        extra = (fill,) if takes_fill else ()
        return func(unwrap(input), size, *extra, **kwargs)

    return rule


for _name in ("new_zeros", "new_ones", "new_empty"):
    register(getattr(torch.Tensor, _name))(_factory_rule(getattr(torch.Tensor, _name), takes_fill=False))
register(torch.Tensor.new_full)(_factory_rule(torch.Tensor.new_full, takes_fill=True))


@register(torch.Tensor.new_tensor)
def _new_tensor(input, data, **kwargs):
    return unwrap(input).new_tensor(data, **kwargs)  # data, not a layout: a plain tensor as in one process


# ----------------------------------------------------------------------------- writes
@register(torch.Tensor.__setitem__)
def setitem(target, index, value):
    """``target[index] = value`` with global indices: each rank writes the rows it owns.

    Writing a domain value into a plain tensor gathers the value whole first (the plain tensor is whole on every
    rank, so a rank writing only its rows would leave the others' rows stale: never a partial write), and the
    tensor becomes a replicated domain tensor.
    """
    if isinstance(index, DomainTensor) and index.dtype == torch.bool:
        return _masked_write(target, index, value)
    if any(isinstance(i, DomainTensor) for i in (index if isinstance(index, tuple) else (index,))):
        raise NotImplementedError(
            f"{op_name(torch.Tensor.__setitem__)} with a domain tensor inside the index: index a domain tensor by ints, "
            "slices and plain tensors, or by one boolean domain tensor laid out like it (x[x > 1] = 1.0)")
    sharded = isinstance(value, DomainTensor) and bool(sharded_dims(value._spec))
    if not isinstance(target, DomainTensor):
        whole = value.full_tensor() if sharded else value  # slabs, blocks and token grids alike
        unwrap(target)[index] = unwrap(whole)
        # NOTE: the target now holds values computed from the domain tensor: it becomes a replicated domain tensor
        # itself, so what is computed from it stays replicated and its gradient follows the replicated convention
        # (summed over the domain where it meets the shards). Left plain, each rank's slice of it would carry only
        # that rank's part of the gradient back into the replicated value: wrong weight gradients (an FNO's
        # spectral weights, whose output spectrum is such a plain buffer).
        target.__class__ = DomainTensor
        target._spec = DomainSpec.replicated(value._spec.comm)
        return None
    if target.spec.dim is None:
        # NOTE: a replicated target (a plain buffer after its first write of a domain value: a rollout's, an FNO's
        # out_ft written twice) is whole on every rank too: a sharded value is gathered whole first. Its shard went
        # into the whole slice before: torch's broadcast error, or where a shard had one row, a silent broadcast
        unwrap(target)[index] = unwrap(value.full_tensor() if sharded else value)
        return None
    spec = target.spec
    items, at, out_dim = _expand(target, index)
    item = items[at]
    n = sum(spec.sizes)
    if isinstance(item, slice):
        start, stop, step = item.indices(n)
    elif isinstance(item, int) or (isinstance(item, torch.Tensor) and item.ndim == 0 and not item.is_floating_point()):
        start = int(item) + (n if int(item) < 0 else 0)
        if not 0 <= start < n:
            raise IndexError(f"index {int(item)} is out of range for the sharded dim {spec.dim} of length {n}")
        stop, step, out_dim = start + 1, 1, None  # an int index drops the dim from the value's view
    else:
        raise NotImplementedError(f"{op_name(torch.Tensor.__setitem__)} with a {type(item).__name__} index along the "
                                  f"sharded dim {spec.dim} is not supported (ints and slices are)")
    per_rank = slice_sizes(spec.sizes, start, stop, step)
    lo, hi, count = per_rank[spec.comm.index]
    items[at] = slice(lo, hi, step)
    region_sizes = tuple(c for _, _, c in per_rank)
    region_offset = sum(region_sizes[:spec.comm.index])
    if isinstance(value, DomainTensor) and value.spec.dim is not None:
        rows = unwrap(value) if value.spec.sizes == region_sizes else redistribute_local(value, region_sizes)
    elif isinstance(value, torch.Tensor) and value.ndim and out_dim is not None:
        aligned = out_dim - (len([i for i in items if not isinstance(i, int)]) - value.ndim)
        whole_length = sum(region_sizes)
        rows = unwrap(value)
        if aligned >= 0 and value.shape[aligned] == whole_length != 1:
            rows = rows.narrow(aligned, region_offset, count)
    else:
        rows = unwrap(value)
    if out_dim is None and not isinstance(item, slice):  # an int index: the owner writes its row, the dim dropped
        if not count:
            return None
        items[at] = lo
    unwrap(target)[tuple(items)] = rows
    return None


# A domain value written into a plain tensor: the same on blocks and token grids (a block-sharded target refuses).
BLOCK_RULES.register(torch.Tensor.__setitem__, setitem)  # a block-sharded target: ops/blocks/writes.py
TOKEN_RULES.register(torch.Tensor.__setitem__, setitem)


def _masked_write(target: Any, mask: DomainTensor, value: Any) -> None:
    """``target[mask] = value``, ``mask`` a boolean domain tensor laid out like ``target`` (``h[h > 1] = 1.0``,
    ``h[torch.isnan(h)] = 0``): each rank writes its own elements, as ``masked_fill_``."""
    op = op_name(torch.Tensor.__setitem__)
    if not isinstance(target, DomainTensor) or tuple(target.shape) != tuple(mask.shape) or target._spec != mask._spec:
        raise NotImplementedError(f"{op} with a boolean domain tensor as the index: the mask must be laid out like the "
                                  "tensor written (x[x > 1] = v on a domain tensor x); else torch.where(mask, v, x)")
    if isinstance(value, torch.Tensor) and value.ndim:  # NOTE: values in the mask's order: one process's layout
        raise NotImplementedError(f"{op} of a tensor of values through a boolean mask: write x = torch.where(mask, "
                                  "values, x), with values laid out like x, or a scalar (x[mask] = 0.0)")
    unwrap(target)[unwrap(mask)] = unwrap(value) if isinstance(value, DomainTensor) else value


def _expand(target: DomainTensor, index) -> tuple[list, int, int]:
    """(index items with ``...`` spelled out, position of the sharded dim's item, that dim's place in the result)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items[e:e + 1] = [slice(None)] * (target.ndim - sum(1 for i in items if i is not None and i is not Ellipsis))
    items += [slice(None)] * (target.ndim - sum(1 for i in items if i is not None))
    seen, out = -1, 0
    for i, item in enumerate(items):
        if item is None:
            out += 1
            continue
        seen += 1
        if seen == target.spec.dim:
            return items, i, out
        if not isinstance(item, int):
            out += 1
    raise AssertionError(index)
