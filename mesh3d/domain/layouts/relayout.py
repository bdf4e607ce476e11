"""Moving a domain tensor between slabs and blocks: ``domain.redistribute(xs, dims=(2, 3))`` and back.

Usage::

    bs = domain.redistribute(xs, dims=(2, 3))            # slabs along dim 2 -> blocks over dims (2, 3)
    xs = domain.redistribute(bs, dim=2)                  # blocks -> slabs along dim 2 (one of the block dims)
    bs = domain.redistribute(bs, dims=(2, 3), sizes=((6, 2), (4, 4)))   # blocks -> blocks (new sizes or dims)

Slabs -> blocks: each rank gathers its block's rows of the slab dim from the slab owners (one exchange
over the whole domain), then keeps its block's part of the other dims, which a slab holds whole.
Blocks -> slabs: each grid line first gathers the other block dims whole, so the ranks whose other grid
coordinates are 0 together hold every row of the slab dim once; every rank then gathers its slab's rows
from them. Only rows that change rank travel; both directions are differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mesh3d.domain.core.specs import BlockSpec, grid_coords
from mesh3d.domain.layouts.blocks import gather_along, grid_comms, in_layout
from mesh3d.domain.comm.rows import block_needs
from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.comm.rows import Span, plan_exchange
from mesh3d.domain.core.split import offsets_of, split_sizes
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.layouts.transpose import move_rows, move_sharding

__all__ = ["blocks_in_layout", "blocks_to_blocks", "blocks_to_slabs", "relayout", "slabs_to_blocks",
           "turned_blocks"]


def slabs_to_blocks(x: DomainTensor, dims: Sequence[int], sizes: Sequence[Sequence[int] | None] | None = None
                    ) -> DomainTensor:
    """``x`` (slabs) as blocks over ``dims``; the slab dim must be one of them.

    Usage: ``bs = slabs_to_blocks(xs, (2, 3))``
    """
    spec = x.spec
    grid, lines = grid_comms()
    dims = tuple(d % x.ndim for d in dims)
    if spec.dim not in dims or len(dims) != len(grid):
        raise ValueError(f"domain.redistribute: dims={dims} must be {len(grid)} dims (the grid {grid}) including the "
                         f"slab dim {spec.dim}")
    whole = x.global_shape
    per_dim = list(sizes) if sizes is not None else [None] * len(dims)
    layout = tuple(split_sizes(whole[d], g, s) for d, g, s in zip(dims, grid, per_dim))
    k = dims.index(spec.dim)
    # every domain rank's rows of the slab dim in the block layout, in domain rank order
    needs = []
    for r in range(spec.comm.size):
        c = grid_coords(r, grid)[k]
        start = offsets_of(layout[k])[c]
        needs.append((Span.rows(start, start + layout[k][c]),) if layout[k][c] else ())
    local = gather_rows(unwrap(x), spec.dim, plan_exchange(spec.sizes, tuple(needs), spec.comm.index), spec.comm)
    out = BlockSpec(dims, layout, lines, spec.comm)
    for axis, (d, start, count) in enumerate(zip(dims, out.offsets, out.local_sizes)):
        if axis != k and count != local.shape[d]:
            local = local.narrow(d, start, count)
    return adopt(local, out)


def blocks_in_layout(t: DomainTensor, spec: BlockSpec) -> torch.Tensor:
    """``t``'s local block laid out as ``spec`` (the same global lengths along ``spec``'s dims).

    NOTE: where ``t``'s grid axes shard other dims (``x.mT``, a face turned by rot90, an inverse SHT's output over
    (channels, lon)), its block is another part of the field even where the sizes agree: it moves over ``spec``'s dims
    first (``blocks_to_blocks``); then each grid line moves the rows whose owner differs (``in_layout``).

    Usage: ``local = blocks_in_layout(skip, ref.spec)``
    """
    if turned_blocks(t, spec):
        return unwrap(blocks_to_blocks(t, spec.dims, spec.sizes))
    have = t._spec
    assert isinstance(have, BlockSpec)
    return unwrap(t) if have.dims == spec.dims and have.sizes == spec.sizes else in_layout(t, spec)


def turned_blocks(t: DomainTensor, spec: BlockSpec) -> bool:
    """Whether block tensor ``t`` is ``spec``'s field with its grid axes on other dims (``x.mT``, a face turned by
    rot90): as many block dims, the global lengths of ``spec``'s dims, other dims. ``blocks_to_blocks`` moves it.

    Usage: ``if turned_blocks(t, ref.spec): t = blocks_to_blocks(t, ref.spec.dims, ref.spec.sizes)``
    """
    have = t._spec
    assert isinstance(have, BlockSpec)
    return have.dims != spec.dims and len(have.dims) == len(spec.dims) and max(spec.dims) < t.ndim \
        and all(t.shape[d] == sum(s) for d, s in zip(spec.dims, spec.sizes))


def blocks_to_slabs(x: DomainTensor, dim: int, sizes: Sequence[int] | None = None) -> DomainTensor:
    """``x`` (blocks) as slabs along ``dim``, one of its block dims.

    Usage: ``xs = blocks_to_slabs(bs, 2)``
    """
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    dim = dim % x.ndim
    if dim not in spec.dims:
        raise ValueError(f"domain.redistribute: dim={dim} must be one of the block dims {spec.dims}")
    k = spec.dims.index(dim)
    local = unwrap(x)
    for axis, (d, s) in enumerate(zip(spec.dims, spec.sizes)):
        if axis != k:  # the other block dims whole on every rank of the line
            local = gather_along(local, spec, axis, ((Span.rows(0, sum(s)),),) * len(s))
    grid = tuple(len(s) for s in spec.sizes)
    owners = []  # the ranks whose other grid coordinates are 0 hold the slab dim's rows once, in order
    for r in range(spec.comm.size):
        c = grid_coords(r, grid)
        owners.append(spec.sizes[k][c[k]] if all(v == 0 for a, v in enumerate(c) if a != k) else 0)
    if owners[spec.comm.index] == 0:
        local = local.narrow(dim, 0, 0)
    slabs = split_sizes(sum(spec.sizes[k]), spec.comm.size, sizes)
    local = gather_rows(local, dim, plan_exchange(tuple(owners), block_needs(slabs), spec.comm.index), spec.comm)
    return adopt(local, DomainSpec(dim, slabs, spec.comm, 1))


def blocks_to_blocks(x: DomainTensor, dims: Sequence[int], sizes=None) -> DomainTensor:
    """``x`` (blocks) as blocks with other ``sizes`` per dim, or over other ``dims``.

    Usage: ``bs = blocks_to_blocks(bs, (2, 3), ((6, 2), (4, 4)))``; ``bs = blocks_to_blocks(bs, (3, 4))``

    Same dims: each grid line moves the rows whose owner changes. A grid axis moving to a dim no axis shards: an
    all-to-all within its grid lines. Other dims (axes swapped): through slabs along a dim both layouts split (or an
    all-to-all between slab dims when they share none).
    """
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    dims = tuple(d % x.ndim for d in dims)
    if len(dims) != len(spec.dims):
        raise ValueError(f"domain.redistribute: dims={dims} must be {len(spec.dims)} dims, one per grid dim")
    if dims == spec.dims:
        per_dim = list(sizes) if sizes is not None else [None] * len(dims)
        target = spec.with_sizes(tuple(split_sizes(sum(s), len(s), want) for s, want in zip(spec.sizes, per_dim)))
        return x if target is spec else adopt(in_layout(x, target), target)
    if all(d == o or d not in spec.dims for d, o in zip(dims, spec.dims)):
        return _move_along_lines(x, spec, dims, sizes)
    common = [d for d in spec.dims if d in dims]
    slabs = blocks_to_slabs(x, common[0] if common else spec.dims[0])
    if not common:
        slabs = move_sharding(slabs, dims[0], None)
    return slabs_to_blocks(slabs, dims, sizes)


def _move_along_lines(x: DomainTensor, spec: BlockSpec, dims: tuple[int, ...], sizes) -> DomainTensor:
    """Each grid axis whose dim changes to one no axis shards (an inverse SHT's output over (channels, lon) back to
    (lat, lon)) swaps it within its own grid lines: an all-to-all of the line, no rank outside it involved."""
    whole = x.global_shape
    per_dim = list(sizes) if sizes is not None else [None] * len(dims)
    target = BlockSpec(dims, tuple(split_sizes(whole[d], len(s), want) for d, s, want in zip(dims, spec.sizes, per_dim)),
                       spec.lines, spec.comm)
    local = unwrap(x)
    for k, (d, o) in enumerate(zip(dims, spec.dims)):
        if d != o:
            local = move_rows(local, spec.lines[k], o, spec.sizes[k], d, target.sizes[k])
    moved = BlockSpec(dims, tuple(t if d != o else s for d, o, s, t in zip(dims, spec.dims, spec.sizes, target.sizes)),
                      spec.lines, spec.comm)
    out = adopt(local, moved)
    return out if moved == target else adopt(in_layout(out, target), target)


def relayout(x: DomainTensor, dim: int | None, dims: Sequence[int] | None, sizes) -> DomainTensor | None:
    """The move between slabs and blocks ``domain.redistribute`` asks for, or None when it asks for a slab move.

    Usage: ``relayout(xs, None, (2, 3), None)``
    """
    if isinstance(x._spec, TokenSpec):
        raise ValueError("domain.redistribute of a token grid: reshape the tokens back to the grid first "
                         "(t.transpose(1, 2).reshape(b, c, h, w)), then redistribute the blocks")
    if dims is not None and not isinstance(x._spec, BlockSpec):
        return slabs_to_blocks(x, dims, sizes)
    if dim is not None and isinstance(x._spec, BlockSpec):
        return blocks_to_slabs(x, dim, sizes)
    if isinstance(x._spec, BlockSpec):
        if dims is None:
            raise ValueError("domain.redistribute on blocks: pass dims= (blocks with new sizes or over other dims) "
                             "or dim= (one of the block dims, to move them to slabs)")
        return blocks_to_blocks(x, dims, sizes)
    return None

