"""Layout rules on blocks: transpose/permute, reshape/view/flatten (to a token grid), chunk/split/unbind, Linear,
softmax (dropout: ``random_ops``).

Usage (through torch)::

    t = e.flatten(2).transpose(1, 2)     # blocks of (B, C, H, W) -> a token grid (B, H*W, C)
    y = e.permute(0, 2, 3, 1)            # channels last: the block dims move with their dims
    z = F.linear(y, w)                   # Linear over a dim that is not a block dim: local

A reshape keeps the block dims' local rows as they are (other dims split and merge freely) or merges
exactly the block dims, consecutive and ascending, into one token dim: ``mesh3d.domain.layouts.tokens``. Anything
else (a reshape splitting the block dims: windows, patches) runs on slabs, the blocks moved there first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d.domain.core.copied_views import made_as_copy, mark_copied_view
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.dispatch.kept_steps import metadata_rule
from mesh3d.domain.ops.grid_local import LocalGrid, local_rules
from mesh3d.domain.ops.grid_reshape import localized, place_run, shape_rules, untouched_index
from mesh3d.domain.ops.idioms import COMPLEX_PARTS, expand_index, index_without_tensors, slice_sizes
from mesh3d.domain.dispatch.registry import BLOCK_RULES, op_name
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.step import Relaid, Step, Whole

__all__: list[str] = []


def _spec(x: DomainTensor) -> BlockSpec:
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    return spec


def _moved(spec: BlockSpec, dims: tuple[int, ...]) -> BlockSpec:
    return BlockSpec(dims, spec.sizes, spec.lines, spec.comm)


def reshape_blocks(x: DomainTensor, target: list[int], op: str, view: bool) -> Any:
    """``x`` reshaped keeping its blocks, or with its block dims merged into a token dim (a step: planned from metadata
    alone), else moved to slabs and reshaped there; else a refusal.

    Usage: ``t = reshape_blocks(e, [b, c, -1], "torch.reshape", view=False)  # a token grid``
    """
    spec, local = _spec(x), unwrap(x)
    shape, whole = list(local.shape), list(size_of(x))
    first, last = min(spec.dims), max(spec.dims)
    run, global_run = shape[first:last + 1], whole[first:last + 1]
    consecutive = spec.dims == tuple(range(first, last + 1))
    placed = localized(place_run(target, whole, first, last, global_run), run) if consecutive else None
    merged = None
    if placed is None and consecutive:
        merged = localized(place_run(target, whole, first, last, [math.prod(global_run)]), [math.prod(run)])
    if placed is not None or merged is not None:
        at, full = placed if placed is not None else merged
        out = _moved(spec, tuple(d - first + at for d in spec.dims)) if placed is not None else \
            TokenSpec(at, spec.sizes, spec.lines, spec.comm)
        return Step((lambda t: t.view(full)) if view else (lambda t: t.reshape(full)), (x,), out=out)
    # NOTE: a window partition or a patching splits the block dims themselves, which no block can do alone: the
    # blocks move to slabs along the first block dim (over the whole grid), where a slab or a strided slab runs it
    if view:
        _check_viewable(local, whole, target)
    # NOTE: contiguous: one process views a contiguous tensor here
    slabs = run_step(Step(torch.Tensor.contiguous, (Relaid(x, first, None),),
                          out=DomainSpec(first, split_sizes(whole[first], spec.comm.size), spec.comm, 1)))
    return mark_copied_view(slabs.view(target), x, op) if view else made_as_copy(slabs.reshape(target))  # copies


def _check_viewable(local: torch.Tensor, whole: list[int], target: list[int]) -> None:
    """Raise torch's own error where the one-process tensor could not be viewed as ``target``: its strides are taken
    in the order of the block's (a block is laid out in memory as the whole tensor is: the same ops made both)."""
    order = sorted(range(local.ndim), key=lambda d: (local.stride(d), -d))  # innermost first
    strides, step = [0] * local.ndim, 1
    for d in order:
        strides[d] = step
        step *= max(whole[d], 1)
    torch.empty_strided(whole, strides, device="meta").view(target)


def _local_unless_block(op: str, x: DomainTensor, dims: list[int]) -> BlockSpec:
    spec = _spec(x)
    touched = sorted({d % x.ndim for d in dims} & set(spec.dims))
    if touched:
        raise NotImplementedError(f"{op} acts along dim {touched[0]}, a block-sharded dim ({spec.dims}); move the "
                                  "channels last (x.permute) or call .full_tensor() first")
    return spec


def _softmax(func):
    @metadata_rule()
    def rule(input, dim=None, *args, **kwargs) -> Step:
        spec = _local_unless_block("softmax", input, [dim])
        return Step(lambda t: func(t, dim, *args, **kwargs), (input,), out=spec)
    return rule


@metadata_rule(when=index_without_tensors)
def _getitem(x: DomainTensor, index) -> Any:
    """Indexing of blocks: anything on the other dims, and slices with a positive step on block dims (each grid line
    keeps its own rows of the slice: the spectrum's modes of an FNO, a crop); an int on a block dim reads that row
    (or plane) whole on every rank, replicated (a pole's ring on a lat x lon grid: one row, gathered)."""
    spec = _spec(x)
    moved = untouched_index(index, x.ndim, spec.dims)
    if moved is not None:
        return Step(lambda t: t[index], (x,), out=_moved(spec, tuple(moved(d) for d in spec.dims)))
    items = expand_index(index, x.ndim)
    picked = _ints_on_block_dims(items, spec)
    if picked:
        for i, (row, _) in picked.items():  # the row as a slice of one: blocks, the row on the grid line that owns it
            items[i] = slice(row, row + 1)
        rows = run_step(_getitem(x, tuple(items)))
        at = sorted((rows._spec.dims[axis] for _, axis in picked.values()), reverse=True)

        def selected(whole: torch.Tensor) -> torch.Tensor:
            for d in at:
                whole = whole.select(d, 0)
            return whole
        return Step(selected, (Whole(rows),), out=DomainSpec.replicated(spec.comm))
    return _slices(x, spec, items)


def _ints_on_block_dims(items: list, spec: BlockSpec) -> dict[int, tuple[int, int]]:
    """{position in ``items``: (its non-negative row, the grid axis of its dim)} of the ints that index a block dim."""
    out, seen = {}, -1
    for i, item in enumerate(items):
        if item is None:
            continue
        seen += 1
        if seen in spec.dims and isinstance(item, int):
            axis = spec.dims.index(seen)
            n = sum(spec.sizes[axis])
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of range for the block dim {seen} of length {n}")
            out[i] = (item + n if item < 0 else item, axis)
    return out


def _slices(x: DomainTensor, spec: BlockSpec, items: list) -> Step:
    sizes, seen, out, new_dims = list(spec.sizes), -1, 0, {}
    for i, item in enumerate(items):
        if item is None:
            out += 1
            continue
        seen += 1
        if seen in spec.dims:
            k = spec.dims.index(seen)
            if not isinstance(item, slice) or (item.step or 1) < 1:
                raise NotImplementedError(f"{op_name(torch.Tensor.__getitem__)} with {item!r} on the block dim {seen}: "
                                          "only slices with a positive step are supported there; call .full_tensor()")
            per_line = slice_sizes(spec.sizes[k], *item.indices(sum(spec.sizes[k])))
            lo, hi, _ = per_line[spec.lines[k].index]
            items[i] = slice(lo, hi, item.step)
            sizes[k] = tuple(c for _, _, c in per_line)
            new_dims[seen] = out
        elif not isinstance(item, (int, slice)):
            raise NotImplementedError(f"{op_name(torch.Tensor.__getitem__)} with a tensor index on blocks is not "
                                      "supported; call .full_tensor() first")
        if not isinstance(item, int):
            out += 1
    out_spec = BlockSpec(tuple(new_dims[d] for d in spec.dims), tuple(sizes), spec.lines, spec.comm)
    index = tuple(items)
    return Step(lambda t: t[index], (x,), out=out_spec)


def _narrow(input, dim, start, length):
    """``narrow`` is a slice (the first modes of an FFT along a block dim: torch-harmonics' SHT keeps them so)."""
    d = dim % input.ndim
    first = int(start) + (input.shape[d] if int(start) < 0 else 0)
    return _getitem(input, (slice(None),) * d + (slice(first, first + int(length)),))


def _complex_part(func):
    """Real and imaginary parts, conjugate, angle, ``view_as_real``: element by element (``view_as_real`` adds a last
    dim, ``view_as_complex`` takes one away: not a block dim)."""
    @metadata_rule()
    def rule(input) -> Step:
        spec = _spec(input)
        if func is torch.view_as_complex and input.ndim - 1 in spec.dims:
            raise NotImplementedError("torch.view_as_complex of blocks split along their last dim (the (real, imag) "
                                      "pairs); call .full_tensor() first")
        return Step(func, (input,), out=spec)

    return rule


for _f in COMPLEX_PARTS:
    BLOCK_RULES.register(_f, _complex_part(_f))


for _f, _rule in local_rules(LocalGrid(_spec, _local_unless_block,
                                        lambda spec, new: _moved(spec, tuple(new(d) for d in spec.dims)), "blocks")).items():
    BLOCK_RULES.register(_f, _rule)
for _funcs, _rule in (
    ((torch.Tensor.__getitem__,), _getitem),
    ((torch.narrow, torch.Tensor.narrow), _narrow),
):
    for _f in _funcs:
        BLOCK_RULES.register(_f, _rule)
for _f in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax):
    BLOCK_RULES.register(_f, _softmax(_f))
for _f, _rule in shape_rules(reshape_blocks).items():
    BLOCK_RULES.register(_f, metadata_rule()(_rule))  # NOTE: its move to slabs is no step: nothing kept of it
