"""Rows of the sharded dim put together anew: ``cat`` of several sharded pieces, ``repeat``/``tile`` along it, and
index tensors along it (``x[..., idx, :]``, ``index_select``), on slabs.

Usage: automatic, through torch::

    torch.cat([x[..., -p:, :], x, x[..., :p, :]], dim=2)    # periodic padding of the sharded dim
    torch.cat([x[:, n // 2:], x[:, :n // 2]], 1)            # halves swapped
    x.repeat(1, 2, 1); x.tile((1, 3, 1))                    # copies of the sharded dim one after another
    x[:, :, lat_idx]; x.index_select(2, lat_idx)            # rows picked by a plain index tensor (global indices)

The result's rows are laid out anew (below), each rank gathering the rows of its part from their owners through the
exchange (``Rows``: one message per sender, and the exact adjoint in backward). Layouts: a cat whose largest sharded
piece holds three quarters of the rows or more keeps that piece's layout, the other pieces joining its first or last
holder (periodic padding moves only the pad rows); other cats, ``repeat`` and non-monotone indices are split as
``torch.chunk`` does; a nondecreasing index keeps each picked row with the rank that holds it (no row moves).
"""

from __future__ import annotations

import torch

from mesh3d.domain.comm.rows import Span, runs_from_indices
from mesh3d.domain.core.split import offsets_of, split_sizes
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap
from mesh3d.domain.dispatch.dispatcher import run_step
from mesh3d.domain.dispatch.registry import STRIDED_RULES, op_name, register
from mesh3d.domain.dispatch.step import Entering, Rows, Step

__all__ = ["cat_pieces", "global_rows", "index_plan", "index_rows", "joined_sizes", "piece_needs"]


def joined_sizes(lengths: list[int], piece_sizes: list, parts: int) -> tuple[int, ...]:
    """The sizes of ``cat``'s result: the dominant sharded piece's layout (``piece_sizes[i]``; None for a whole piece)
    with the others joining its first or last holder, else ``torch.chunk``'s split.

    Usage: ``joined_sizes([2, 9, 2], [(0, 2), (5, 4), (2, 0)], 2)  # (7, 6)``
    """
    total = sum(lengths)
    best = max((i for i, s in enumerate(piece_sizes) if s is not None), key=lambda i: lengths[i], default=None)
    if best is None or 4 * lengths[best] < 3 * total:
        return split_sizes(total, parts)
    sizes = list(piece_sizes[best])
    holders = [r for r, n in enumerate(sizes) if n] or [0, parts - 1]
    sizes[holders[0]] += sum(lengths[:best])
    sizes[holders[-1]] += sum(lengths[best + 1:])
    return tuple(sizes)


def piece_needs(sizes: tuple[int, ...], at: int, n: int) -> tuple[tuple, ...]:
    """Per rank: the rows of a piece (rows ``at .. at + n`` of the result laid out as ``sizes``) it holds, as runs of
    the piece's own rows; and this rank's (start, count) of them is ``needs[r]``'s one span."""
    starts = offsets_of(sizes)
    out = []
    for o, c in zip(starts, sizes):
        a, b = max(o, at) - at, min(o + c, at + n) - at
        out.append((Span.rows(a, b),) if b > a else ())
    return tuple(out)


def index_plan(rows: list[int], sizes: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], tuple]:
    """(the result's sizes, each rank's needs) of picking global ``rows`` of a dim laid out as ``sizes``: a
    nondecreasing pick keeps each row with its holder; any other is split as ``torch.chunk`` does."""
    owners = offsets_of(sizes)
    if all(a <= b for a, b in zip(rows, rows[1:])):
        out = tuple(sum(1 for r in rows if o <= r < o + c) for o, c in zip(owners, sizes))
    else:
        out = split_sizes(len(rows), parts)
    return out, tuple(runs_from_indices(rows[b:b + c]) for b, c in zip(offsets_of(out), out))


def global_rows(index: torch.Tensor, n: int, dim: int) -> list[int]:
    """A plain 1-D integer index (negative allowed) or a bool mask of length ``n`` as a list of global rows."""
    if isinstance(index, DomainTensor):
        raise NotImplementedError("an index tensor that is a domain tensor along the sharded dim is not supported; "
                                  "index with a plain tensor of global indices")
    if index.dtype == torch.bool:
        if index.ndim != 1 or index.shape[0] != n:
            raise IndexError(f"a bool index along the sharded dim {dim} must be 1-D of its length {n}; got shape "
                             f"{tuple(index.shape)}")
        index = index.nonzero().flatten()
    if index.ndim != 1 or index.is_floating_point():
        raise NotImplementedError(f"an index tensor along the sharded dim {dim} must be a 1-D integer tensor (got "
                                  f"{tuple(index.shape)} {index.dtype}); flatten it and reshape the result")
    rows = [int(i) + (n if int(i) < 0 else 0) for i in index.tolist()]
    if any(not 0 <= r < n for r in rows):
        raise IndexError(f"index out of range for the sharded dim {dim} of length {n}")
    return rows


def cat_pieces(tensors: list, dim: int, ref: DomainTensor) -> Step:
    """``torch.cat(tensors, dim)`` along the sharded dim of several sharded pieces (and plain or replicated ones).

    Usage: ``cat_pieces([left, xs, right], 2, xs)`` (the ``torch.cat`` rule calls it)
    """
    spec = ref.spec
    sharded = [t if isinstance(t, DomainTensor) and t.spec.dim is not None else None for t in tensors]
    for t in sharded:
        if t is not None and (t.ndim - t.spec.dim != ref.ndim - spec.dim or t.spec.outer != 1):
            raise NotImplementedError("torch.cat along the sharded dim: every sharded piece must be a slab sharded "
                                      f"along that dim (dim {spec.dim}); move a piece sharded otherwise with "
                                      f"domain.redistribute(t, dim={spec.dim}), reshape strided pieces back first")
    lengths = [size_of(t)[dim] for t in tensors]
    sizes = joined_sizes(lengths, [None if t is None else t.spec.sizes for t in sharded], spec.comm.size)
    me = spec.comm.index
    reqs, at = [], 0
    for t, s, n in zip(tensors, sharded, lengths):
        needs = piece_needs(sizes, at, n)
        if s is not None:
            reqs.append(Rows(s, needs))
        else:
            whole = Entering(t) if isinstance(t, DomainTensor) else t
            mine = needs[me]
            reqs.append((whole, mine[0].start if mine else 0, len(mine[0]) if mine else 0))
        at += n

    def compute(*parts):
        local = [p[0].narrow(dim, p[1], p[2]) if isinstance(p, tuple) else p for p in parts]
        return torch.cat(local, dim)

    flat = [r for req in reqs for r in (req if isinstance(req, tuple) else (req,))]
    shapes = [isinstance(r, tuple) for r in reqs]

    def run(*args):
        it, parts = iter(args), []
        for is_whole in shapes:
            parts.append((next(it), next(it), next(it)) if is_whole else next(it))
        return compute(*parts)

    return Step(run, tuple(flat), out=spec.with_sizes(sizes),
                keep=tuple(t for t in tensors if not isinstance(t, DomainTensor)))


def index_rows(x: DomainTensor, dim: int, index: torch.Tensor) -> Step:
    """``x.index_select(dim, index)`` along the sharded dim (``index``: a plain 1-D tensor of global rows, or a bool
    mask of the dim's length): each rank gathers the rows of its part of the result from their owners.

    Usage: ``index_rows(xs, 2, torch.tensor([0, 2, 4]))``
    """
    spec = x.spec
    sizes, needs = index_plan(global_rows(index, sum(spec.sizes), dim), spec.sizes, spec.comm.size)
    return Step(lambda t: t, (Rows(x, needs),), out=spec.with_sizes(sizes))


def _repeat_sizes(sizes: tuple) -> tuple[int, ...]:
    return tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else tuple(sizes)


@register(torch.Tensor.repeat)
def _repeat(input, *sizes):
    """Copies along every dim: local where the sharded dim is copied once, else the copies' cat along it."""
    reps = _repeat_sizes(sizes)
    if len(reps) < input.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor")
    spec = input.spec
    new = len(reps) - input.ndim
    dim = spec.dim + new
    local = list(reps)
    local[dim] = 1
    step = Step(lambda t: t.repeat(local), (input,), out=spec.with_sizes(spec.sizes, dim=dim))
    if reps[dim] == 1:
        return step
    copied = run_step(step)
    return cat_pieces([copied] * reps[dim], dim, copied)


@register(torch.tile, torch.Tensor.tile)
def _tile(input, *dims):
    reps = _repeat_sizes(dims)
    return _repeat(input, *((1,) * (input.ndim - len(reps)) + reps))


@register(torch.index_select, torch.Tensor.index_select)
def _index_select(input, dim, index):
    d = dim % input.ndim
    if d != input.spec.dim:
        return Step(lambda t, i: torch.index_select(t, d, i), (input, unwrap(index)), out=input.spec)
    return index_rows(input, d, unwrap(index))


def _strided_cat(tensors, dim=0):
    """``torch.cat`` on a strided layout: of one tensor (einops' ``pack`` of one), or along another dim of operands
    laid out alike (local); along the strided dim it is refused."""
    tensors = list(tensors)
    ref = next(t for t in tensors if isinstance(t, DomainTensor) and t.spec.dim is not None)
    d = dim % ref.ndim
    alike = all(isinstance(t, DomainTensor) and t.spec == ref.spec for t in tensors)
    if len(tensors) > 1 and (d == ref.spec.dim or not alike):
        raise NotImplementedError(f"{op_name(torch.cat)} of strided domain tensors along the strided dim or with "
                                  "tensors laid out otherwise: reshape them back to their unstrided shapes first")
    return Step(lambda *ts: torch.cat(ts, d), tuple(tensors), out=ref.spec)


for _f in (torch.cat, torch.concat):
    STRIDED_RULES.register(_f, _strided_cat)
