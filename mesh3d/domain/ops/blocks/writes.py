"""``target[index] = value`` into a block-sharded tensor: each rank writes the part of the indexed region it holds.

Usage: automatic, through torch::

    ys = F.pad(xs, (0, 0, 1, 1))                 # lat x lon blocks, a row padded on at each pole
    ys[..., 0, :] = north                        # north: (B, C, 1), whole on every rank (a pole's value)

On each block dim the index is an int (the row: written by the grid line that owns it) or a slice with step 1 (each
rank its rows of it); the value is whole (plain or replicated) and, along every sliced block dim, of size 1 (it
broadcasts there, as a pole's value over the longitudes), so every rank writes the same value into its own part.
Anything else is refused by name. A plain target takes the slab rule's write (``ops.global_index``).
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.tensor import DomainTensor, unwrap
from mesh3d.domain.dispatch.executor import resolved
from mesh3d.domain.dispatch.registry import BLOCK_RULES, op_name
from mesh3d.domain.dispatch.step import Entering
from mesh3d.domain.ops.global_index import setitem as plain_target_setitem
from mesh3d.domain.ops.idioms import expand_index

__all__: list[str] = []

_NAME = op_name(torch.Tensor.__setitem__)


def _setitem(target, index, value):
    spec = target._spec if isinstance(target, DomainTensor) else None
    if not isinstance(spec, BlockSpec):
        return plain_target_setitem(target, index, value)
    if isinstance(value, DomainTensor) and value._spec.sharded_dims:
        raise NotImplementedError(f"{_NAME} of a sharded value into blocks has no rule; write a whole (replicated or "
                                  "plain) value, or call .full_tensor() on it first")
    items = expand_index(index, target.ndim)
    # NOTE: every rank writes, an int on a block dim taken as a slice of one row or none (then nothing is written but
    # the value is in the graph): a replicated value's gradient is summed over the domain on the way back, which each
    # rank must reach
    local, sliced, ints, seen, at = list(items), [], [], -1, 0
    for i, item in enumerate(items):
        if item is None:
            at += 1
            continue
        seen += 1
        if seen in spec.dims:
            k = spec.dims.index(seen)
            n, first, count = sum(spec.sizes[k]), spec.offsets[k], spec.local_sizes[k]
            if isinstance(item, int):
                if not -n <= item < n:
                    raise IndexError(f"index {item} is out of range for the block dim {seen} of length {n}")
                row = item + n if item < 0 else item
                local[i] = slice(row - first, row - first + 1) if first <= row < first + count else slice(0, 0)
                ints.append(at)
            elif isinstance(item, slice) and (item.step or 1) == 1:
                start, stop, _ = item.indices(n)
                lo, hi = max(start, first), min(stop, first + count)
                local[i] = slice(lo - first, max(hi, lo) - first)
                sliced.append(at)
            else:
                raise NotImplementedError(f"{_NAME} with {item!r} on the block dim {seen}: ints and slices of step 1 "
                                          "are written into blocks; call .full_tensor() first")
            at += 1
            continue
        if not isinstance(item, (int, slice)):
            raise NotImplementedError(f"{_NAME} with a tensor index into blocks has no rule; call .full_tensor() first")
        if not isinstance(item, int):
            at += 1
    region = at  # dims of the local region, an int on a block dim kept as a dim of one
    # NOTE: a replicated value enters every block: its gradient summed over the domain (``step.Entering``)
    v = resolved(Entering(value)) if isinstance(value, DomainTensor) else value if isinstance(value, torch.Tensor) \
        else torch.as_tensor(value)
    kept = [p for p in range(region) if p not in ints]  # the region torch sees (the ints' dims dropped)
    if v.ndim > len(kept):
        raise RuntimeError(f"{_NAME}: a value of {v.ndim} dims into a region of {len(kept)}")
    first = kept[len(kept) - v.ndim] if v.ndim else region  # where the value's first dim sits in the local region
    for d in ints:  # each dim an int drops, put back where it falls inside the value's span
        if d > first:
            v = v.unsqueeze(d - first)
    for d in sliced:  # the value broadcasts along every sliced block dim, or the ranks' parts would differ
        p = d - (region - v.ndim)
        if p >= 0 and v.shape[p] != 1:
            raise NotImplementedError(f"{_NAME} into blocks with a value of length {v.shape[p]} along the block dim it "
                                      "slices: write a value of size 1 there (it broadcasts), or call .full_tensor()")
    unwrap(target)[tuple(local)] = v
    return None


BLOCK_RULES.register(torch.Tensor.__setitem__, _setitem, override=True)
