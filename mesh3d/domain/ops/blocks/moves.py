"""Rows moved along a block dim: ``roll``, ``flip``, ``cat`` of several pieces along it (periodic padding of longitude),
index tensors along it, ``repeat``/``tile``/``expand``; on blocks of a domain grid.

Usage: automatic, through torch::

    xs.roll(3, dims=-1)                                     # longitude rolled on a lat x lon grid of blocks
    xs.flip(-2); torch.rot90(xs, 1, (-2, -1))               # a face turned (rot90 is a flip and a transpose)
    torch.cat([xs[..., -p:], xs, xs[..., :p]], dim=-1)      # periodic padding along a block dim
    xs[..., lat_idx, :]; xs.index_select(2, lat_idx)        # rows picked by a plain index tensor
    xs.repeat(1, 2, 1, 1); xs.expand(3, -1, -1, -1)         # copies of other dims (of a block dim: a cat)

Each is the slab rule along one grid line: the rows of that block dim travel along the line (``gather_along``), the
other block dims stay as they are; the result's sizes along it follow ``mesh3d.domain.ops.pieces``.
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.kept_steps import metadata_rule
from mesh3d.domain.dispatch.registry import BLOCK_RULES, op_name
from mesh3d.domain.dispatch.step import Entering, LineRows, Step
from mesh3d.domain.layouts.blocks import layout_gathers
from mesh3d.domain.layouts.relayout import blocks_to_blocks
from mesh3d.domain.ops.blocks import layout, resample  # noqa: F401  (their rules, wrapped here, registered first)
from mesh3d.domain.ops.global_index import flipped_dims, mirrored_rows, rolled_rows
from mesh3d.domain.ops.idioms import expand_index, index_without_tensors
from mesh3d.domain.ops.pieces import global_rows, index_plan, joined_sizes, piece_needs

__all__: list[str] = []


def _spec(x: DomainTensor) -> BlockSpec:
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    return spec


def _roll(input, shifts, dims=None):
    if dims is None:
        raise NotImplementedError("torch.roll without dims= flattens the tensor, mixing the block dims; give dims=")
    spec = _spec(input)
    shifts_t = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims_t = [d % input.ndim for d in ((dims,) if isinstance(dims, int) else dims)]
    others = [(s, d) for s, d in zip(shifts_t, dims_t) if d not in spec.dims]
    gathers = []
    for axis, d in enumerate(spec.dims):
        along = sum(s for s, e in zip(shifts_t, dims_t) if e == d)
        n = sum(spec.sizes[axis])
        if n and along % n:
            gathers.append((axis, tuple(rolled_rows(o, c, along, n)
                                        for o, c in zip(offsets_of(spec.sizes[axis]), spec.sizes[axis]))))

    def local_roll(t: torch.Tensor) -> torch.Tensor:
        return torch.roll(t, [s for s, _ in others], [d for _, d in others]) if others else t.view_as(t)

    return Step(local_roll, (LineRows(input, tuple(gathers)),), out=spec)


def _turned_back(t: DomainTensor, spec: BlockSpec, axis: int) -> DomainTensor:
    """``t`` over ``spec``'s block dims. NOTE: a piece turned by rot90 (a cube-sphere face's halo) has its grid axes on
    swapped dims: it moves to ``spec``'s (an all-to-all through slabs), its length along ``axis`` split evenly."""
    have = _spec(t)
    if have.dims == spec.dims or sorted(have.dims) != sorted(spec.dims):
        return t
    return blocks_to_blocks(t, spec.dims, [None if k == axis else s for k, s in enumerate(spec.sizes)])


def cat_along_block_dim(tensors: list, dim: int, ref: DomainTensor) -> DomainTensor:
    """``torch.cat`` along the block dim ``dim`` of block pieces (and plain or replicated ones of global lengths).

    Usage: ``cat_along_block_dim([left, xs, right], 3, xs)``
    """
    spec = _spec(ref)
    axis = spec.dims.index(dim)
    line = spec.lines[axis]
    lengths = [size_of(t)[dim] for t in tensors]
    blocks = [_turned_back(t, spec, axis) if isinstance(t, DomainTensor) and isinstance(t._spec, BlockSpec) else None
              for t in tensors]
    sizes = joined_sizes(lengths, [None if b is None else _spec(b).sizes[axis] for b in blocks], line.size)
    parts, at = [], 0  # NOTE: per piece, its requirement and what narrows it to this rank's rows (None: nothing)
    for t, b, n in zip(tensors, blocks, lengths):
        needs = piece_needs(sizes, at, n)
        if b is not None:
            if _spec(b).dims != spec.dims:
                raise NotImplementedError(f"{op_name(torch.cat)} on blocks: pieces with other block dims")
            parts.append((LineRows(b, (*layout_gathers(_spec(b), spec, skip=axis), (axis, needs))), None))
        else:
            if isinstance(t, DomainTensor) and t._spec.sharded_dims:
                raise NotImplementedError(f"{op_name(torch.cat)} on blocks: a piece laid out otherwise than blocks")
            mine = needs[line.index]
            cut = [(d, spec.offsets[k], spec.local_sizes[k]) for k, d in enumerate(spec.dims) if k != axis]
            cut.append((dim, mine[0].start if mine else 0, len(mine[0]) if mine else 0))
            parts.append((Entering(t) if isinstance(t, DomainTensor) else t, cut))
        at += n
    new = list(spec.sizes)
    new[axis] = sizes
    cuts = [cut for _, cut in parts]

    def joined(*pieces: torch.Tensor) -> torch.Tensor:
        return torch.cat([p if cut is None else _narrowed(p, cut) for p, cut in zip(pieces, cuts)], dim)

    return run_step(Step(joined, tuple(req for req, _ in parts), out=spec.with_sizes(tuple(new)),
                         keep=tuple(t for t in tensors if not isinstance(t, DomainTensor))))


def _narrowed(t: torch.Tensor, cut: list) -> torch.Tensor:
    for d, start, length in cut:
        t = t.narrow(d, start, length)
    return t


_BLOCK_CAT = BLOCK_RULES.get(torch.cat)


def _cat(tensors, dim=0):
    first = next(t for t in tensors if isinstance(t, DomainTensor) and isinstance(t._spec, BlockSpec))
    d = dim % first.ndim
    if d in _spec(first).dims:
        return cat_along_block_dim(list(tensors), d, first)
    return _BLOCK_CAT(tensors, dim)


def _index_along(x: DomainTensor, dim: int, index: torch.Tensor) -> Step:
    spec = _spec(x)
    axis = spec.dims.index(dim)
    sizes, needs = index_plan(global_rows(index, sum(spec.sizes[axis]), dim), spec.sizes[axis], spec.lines[axis].size)
    new = list(spec.sizes)
    new[axis] = sizes
    return Step(_itself, (LineRows(x, ((axis, needs),)),), out=spec.with_sizes(tuple(new)))


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


_BLOCK_GETITEM = BLOCK_RULES.get(torch.Tensor.__getitem__)


@metadata_rule(when=index_without_tensors)
def _getitem(x, index):
    """A 1-D index tensor on one block dim (``x[..., lat_idx, :]``): those rows gathered along the grid line."""
    items = expand_index(index, x.ndim)
    tensors = [i for i, item in enumerate(items) if isinstance(item, (torch.Tensor, list))]
    if len(tensors) == 1 and isinstance(x, DomainTensor):
        at = tensors[0]
        dim = sum(1 for item in items[:at] if item is not None)
        if dim in _spec(x).dims:
            picked = run_step(_index_along(x, dim, torch.as_tensor(items[at])))
            rest = tuple(slice(None) if i == at else item for i, item in enumerate(items))
            return _BLOCK_GETITEM(picked, rest)
    return _BLOCK_GETITEM(x, index)


def _index_select(input, dim, index):
    d = dim % input.ndim
    if d in _spec(input).dims:
        return _index_along(input, d, unwrap(index))
    return adopt(torch.index_select(unwrap(input), d, unwrap(index)), _spec(input))


def _reps(sizes: tuple) -> tuple[int, ...]:
    return tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else tuple(sizes)


def _repeat(input, *sizes):
    reps = _reps(sizes)
    spec = _spec(input)
    new = len(reps) - input.ndim
    local = list(reps)
    dims = tuple(d + new for d in spec.dims)
    for d in dims:
        local[d] = 1
    out = adopt(unwrap(input).repeat(local), type(spec)(dims, spec.sizes, spec.lines, spec.comm))
    for d in dims:
        if reps[d] != 1:
            out = cat_along_block_dim([out] * reps[d], d, out)
    return out


def _tile(input, *dims):
    reps = _reps(dims)
    return _repeat(input, *((1,) * (input.ndim - len(reps)) + reps))


def _expand(input, *sizes):
    sizes_t = _reps(sizes)
    spec = _spec(input)
    new = len(sizes_t) - input.ndim
    whole = size_of(input)
    local = list(sizes_t)
    for d in spec.dims:
        if sizes_t[d + new] not in (-1, whole[d]):
            raise RuntimeError(f"torch.Tensor.expand{sizes_t}: the size at the block dim {d + new} must stay "
                               f"{whole[d]} (or -1), as in one process")
        local[d + new] = -1
    return adopt(unwrap(input).expand(local), type(spec)(tuple(d + new for d in spec.dims), spec.sizes, spec.lines,
                                                         spec.comm))


def _flip(input, *dims, **kwargs):
    """A flip along block dims: each rank fetches the mirror image of its rows along each flipped line, then flips
    locally; the sizes stay (a cube-sphere face turned by ``rot90``)."""
    flipped = flipped_dims(dims, kwargs, input.ndim)
    spec = _spec(input)
    gathers = tuple((axis, mirrored_rows(spec.sizes[axis])) for axis, d in enumerate(spec.dims) if d in flipped)
    return Step(lambda t: torch.flip(t, flipped), (LineRows(input, gathers),), out=spec)


def _stack(tensors, dim=0, *, out=None):
    """``torch.stack`` as torch defines it: each piece unsqueezed at ``dim``, then joined there (the block rules)."""
    if out is not None:
        raise NotImplementedError("torch.stack(out=) on blocks: assign the result instead")
    d = dim % (tensors[0].ndim + 1)
    return torch.cat([t.unsqueeze(d) for t in tensors], d)


def _unsqueeze(input, dim):
    spec = _spec(input)
    d = dim % (input.ndim + 1)
    return adopt(unwrap(input).unsqueeze(d), type(spec)(tuple(b + (b >= d) for b in spec.dims), spec.sizes,
                                                        spec.lines, spec.comm))


def _squeeze(input, dim=None):
    spec = _spec(input)
    whole = size_of(input)
    dims = range(input.ndim) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    gone = sorted({d % input.ndim for d in dims if whole[d % input.ndim] == 1} - set(spec.dims))
    local = unwrap(input).squeeze(tuple(gone)) if gone else unwrap(input).view_as(unwrap(input))
    return adopt(local, type(spec)(tuple(b - sum(g < b for g in gone) for b in spec.dims), spec.sizes, spec.lines,
                                   spec.comm))


for _funcs, _rule in (
    ((torch.unsqueeze, torch.Tensor.unsqueeze), _unsqueeze),
    ((torch.squeeze, torch.Tensor.squeeze), _squeeze),
    ((torch.roll, torch.Tensor.roll), _roll),
    ((torch.flip, torch.Tensor.flip), _flip),
    ((torch.fliplr, torch.Tensor.fliplr), lambda input: _flip(input, [1])),
    ((torch.flipud, torch.Tensor.flipud), lambda input: _flip(input, [0])),
    ((torch.cat, torch.concat), _cat),
    ((torch.stack,), _stack),
    ((torch.Tensor.__getitem__,), _getitem),
    ((torch.index_select, torch.Tensor.index_select), _index_select),
    ((torch.Tensor.repeat,), _repeat),
    ((torch.tile, torch.Tensor.tile), _tile),
    ((torch.Tensor.expand,), _expand),
):
    for _f in _funcs:
        BLOCK_RULES.register(_f, _rule, override=True)
