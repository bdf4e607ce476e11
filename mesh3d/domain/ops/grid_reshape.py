"""Reshapes of blocks and token grids: find where a run of sharded dims lands in the target shape.

Usage: ``at, shape = place_run(target, local.shape, first, last, run)`` (the reshape rules of ``ops.blocks_layout``
and ``ops.tokens`` call it).

A reshape of a block or token-grid tensor is exact on every rank when it keeps the sharded dims' local
run of sizes (the block's rows, the tokens) intact, with the same number of elements before and after
it: the other dims may split and merge freely (``(B, N, heads*hd) -> (B, N, heads, hd)``). The run may
also be replaced by another run holding the same rows in the same order: the block dims merged into
tokens (``flatten(2)``) or the tokens split back into the block (``reshape(b, c, h, w)``). The target is
global (sizes read from ``.shape``, as in one process): the run is placed in the global shape, and this
rank reshapes to the same target with its local run there; every rank decides alike. A target that does
not keep the run is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mesh3d.domain.core.tensor import DomainTensor, size_of

__all__ = ["localized", "place_run", "shape_rules", "target_shape", "untouched_index"]


def target_shape(args: tuple, op: str) -> list[int]:
    """The ints of a ``view``/``reshape`` target given as ``(*sizes)`` or ``(sizes,)``.

    Usage: ``target_shape((b, -1, c), "torch.reshape")``
    """
    shape = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)
    if not all(isinstance(s, int) for s in shape):
        raise NotImplementedError(f"{op} of a domain tensor needs a shape of ints, got {args!r}")
    return [int(s) for s in shape]


def _solve(dims: list[int], total: int) -> list[int] | None:
    """``dims`` with a ``-1`` solved so that they hold ``total`` elements, or None when they cannot."""
    if -1 not in dims:
        return dims if math.prod(dims) == total else None
    known = math.prod([d for d in dims if d != -1])
    if known <= 0 or total % known:
        return None
    return [total // known if d == -1 else d for d in dims]


def place_run(target: Sequence[int], local: Sequence[int], first: int, last: int,
              run: Sequence[int]) -> tuple[int, list[int]] | None:
    """Where in ``target`` the sizes ``run`` (replacing ``local[first..last]``) sit with the elements before and
    after unchanged, and the local shape to reshape to (``-1`` solved); None when nowhere.

    Usage: ``place_run([2, 3, -1], [2, 3, 4, 5], 2, 3, [20])  # (2, [2, 3, 20]): block dims flattened into tokens``

    NOTE: a ``-1`` is solved from the run and the other dims, never from the element count: an empty block has
    none, and must still find the same position and shape as its peers.
    """
    before, after = math.prod(local[:first]), math.prod(local[last + 1:])
    found = []
    for k in range(len(target) - len(run) + 1):
        window = target[k:k + len(run)]
        if any(t not in (-1, r) for t, r in zip(window, run)) or list(target).count(-1) > 1:
            continue
        lead, tail = _solve(list(target[:k]), before), _solve(list(target[k + len(run):]), after)
        if lead is not None and tail is not None:
            # NOTE: a size-1 dim next to the run can make two positions fit; the one keeping the leading dims as
            # they were is what the code meant (and it is the same on every rank).
            found.append((lead != list(local[:first]), k, [*lead, *run, *tail]))
    if not found:
        return None
    _, k, shape = min(found)
    return k, shape


def untouched_index(index: Any, ndim: int, sharded: Sequence[int]) -> Callable[[int], int] | None:
    """For an index that leaves every sharded dim whole (``qkv[0]``, ``t[..., :c]``): where each of those dims lands in
    the result (a map old dim -> new dim); None when the index touches a sharded dim or is not ints, slices, ``None``
    and ``...``. Such an index runs on the local block as it is.

    Usage: ``moved = untouched_index(index, x.ndim, spec.dims)``
    """
    items = list(index) if isinstance(index, tuple) else [index]
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items) or items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (ndim - sum(1 for i in items if i is not None and i is not Ellipsis))
    items += [slice(None)] * (ndim - sum(1 for i in items if i is not None))
    where, seen, out = {}, -1, 0
    for item in items:
        if item is None:
            out += 1
            continue
        seen += 1
        if seen in sharded:
            if item != slice(None):
                return None
            where[seen] = out
        if not isinstance(item, int):
            out += 1
    return where.__getitem__


def localized(placed: tuple[int, list[int]] | None, local_run: Sequence[int]) -> tuple[int, list[int]] | None:
    """A placement found in the global shape (``place_run``) with the run replaced by this rank's local run.

    Usage: ``at, local_target = localized(place_run(target, whole, 2, 3, global_run), local_run)``
    """
    if placed is None:
        return None
    at, full = placed
    return at, [*full[:at], *local_run, *full[at + len(local_run):]]


def shape_rules(reshape: Callable[[DomainTensor, list[int], str, bool], Any]) -> dict[Callable, Callable]:
    """The view / reshape / flatten / unflatten rules of a layout, from its ``reshape(x, target, op, view)``.

    Usage: ``for f, rule in shape_rules(reshape_tokens).items(): TOKEN_RULES.register(f, rule)``
    """
    def reshape_rule(op: str, view: bool) -> Callable:
        def rule(input, *shape):
            if len(shape) == 1 and isinstance(shape[0], torch.dtype):
                raise NotImplementedError(f"{op}(dtype) on a domain tensor is not supported; call .to_local()")
            return reshape(input, target_shape(shape, op), op, view)
        return rule

    def flatten(input, start_dim=0, end_dim=-1):
        shape = list(size_of(input))
        start, end = start_dim % len(shape), end_dim % len(shape)
        return reshape(input, [*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:]],
                       f"torch.flatten(start_dim={start_dim}, end_dim={end_dim}) ->", False)

    def unflatten(input, dim, sizes):
        shape = list(size_of(input))
        d = dim % len(shape)
        return reshape(input, [*shape[:d], *sizes, *shape[d + 1:]], "torch.unflatten", False)

    view, other = reshape_rule("torch.Tensor.view", True), reshape_rule("torch.reshape", False)
    return {torch.Tensor.view: view, torch.reshape: other, torch.Tensor.reshape: other, torch.flatten: flatten,
            torch.Tensor.flatten: flatten, torch.unflatten: unflatten, torch.Tensor.unflatten: unflatten}
