"""``view``/``reshape``/``flatten``/``unflatten`` of a domain tensor, with the target shape in global sizes.

The target is what the same call means in one process: ``x.view(b, t, heads, hd)`` with ``t = x.shape[1]`` (the
global length) and ``-1`` inferred from the global element count. A reshape is exact on shards when every row of
the sharded dim stays a row of one target dim, with the same dims before it (by element count), the row possibly
merged with whole dims after it (as ``flatten`` does) or a run of tokens split into whole rows (the inverse of
``flatten(2)``): then the global reshape is the concatenation of the local ones, each rank's local target the
global one with its own number of rows. A reshape that would mix rows of the sharded dim with the dims before it
is refused, naming the shapes.

Usage (through torch; nothing to call)::

    q = q_proj(x).view(b, t, heads, hd).transpose(1, 2)   # x sharded along dim 1 -> q along dim 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mesh3d.domain.core.copied_views import made_as_copy, mark_copied_view
from mesh3d.domain.dispatch.dispatcher import run_step
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.step import Resplit, Step
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, size_of

__all__ = ["NeedsAlignment", "Placement", "aligned_to", "place_rows", "reshaped", "target_shape"]


def target_shape(args: tuple, numel: int) -> list[int]:
    """The target shape of ``view(*args)``/``reshape(*args)`` of a tensor of ``numel`` elements (``-1`` inferred).

    Usage: ``target_shape((b, -1, c), xs.numel())``
    """
    shape = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)
    if not all(isinstance(s, int) for s in shape):
        raise NotImplementedError(f"view/reshape of a domain tensor needs a shape of ints, got {args!r}")
    if shape.count(-1) > 1:
        raise RuntimeError(f"only one dimension can be inferred (shape {tuple(shape)})")
    known = math.prod([s for s in shape if s != -1])
    if -1 in shape:
        if known == 0 or numel % known:
            raise RuntimeError(f"shape {list(shape)} is invalid for input of size {numel}")
        shape[shape.index(-1)] = numel // known
    elif known != numel:
        raise RuntimeError(f"shape {list(shape)} is invalid for input of size {numel}")
    return shape


@dataclass(frozen=True)
class Placement:
    """Where a reshape puts the sharded rows: target dim ``dim``, each rank's ``n`` rows becoming ``n * after // rest``
    target rows per block, ``outer`` blocks (the dims before it that the target merges in: a strided layout)."""

    dim: int
    after: int
    rest: int
    outer: int

    def sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n * self.after // self.rest for n in sizes)


class NeedsAlignment(Exception):
    """The target splits the rows into whole target rows of ``unit`` rows each, and some rank's run is not whole."""

    def __init__(self, dim: int, unit: int) -> None:
        super().__init__(dim, unit)
        self.dim, self.unit = dim, unit


def place_rows(virtual: tuple[int, ...], dim: int, target: list[int], sizes: tuple[int, ...]) -> Placement | None:
    """Where the rows of the sharded dim ``dim`` of the global shape ``virtual`` land in the global ``target``; None.

    ``virtual`` is the global shape with a strided dim seen as ``(outer, rows)``. Target dim ``c`` holds the rows
    when, per index of the target dims before it, each rank's block of ``n_r * after`` elements is whole target
    rows of ``rest`` elements: then the global reshape is the concatenation of the local ones, block by block.
    That covers keeping the rows; merging them with whole dims after (``flatten``); merging whole dims *before*
    them in (``view(-1, c)`` of ``(B, T, c)``: a strided layout of ``outer = B`` blocks) or splitting such dims
    out again; and splitting a token run into ``(rows, W)`` (the inverse of ``flatten(2)``) when every rank's run
    is whole rows (else ``NeedsAlignment``). Every rank decides from the global ``sizes``; with dims of size 1 next
    to a shard of length 1 the first fitting target dim is taken.
    """
    rows = virtual[dim]
    after = math.prod(virtual[dim + 1:])
    merged_after = {math.prod(virtual[dim + 1:dim + 1 + k]) for k in range(len(virtual) - dim)}
    merged_before = {math.prod(virtual[j:dim]): j for j in range(dim, -1, -1)}  # whole dims just before the rows
    before = math.prod(virtual[:dim])
    found, misaligned = [], None
    for candidate, size in enumerate(target):
        rest, target_before = math.prod(target[candidate + 1:]), math.prod(target[:candidate])
        if rest == 0 or target_before == 0 or before % target_before:
            continue
        outer = before // target_before
        # NOTE: the dims before the rows are whole, so their flattened index splits at any divisor: ``outer`` blocks
        # need not be whole dims (Swin's shifted-window mask splits a batch of windows of several samples, sharded
        # along each sample's window columns, back into (samples, windows per sample)). Prefer no strided layout,
        # then blocks that are whole dims, then targets keeping the dims before the rows as they are.
        # NOTE: and rows that stay rows over a dim of size 1 (``view(1, n, ...)`` of n sharded rows) only when nothing
        # else takes them: a sharded dim of size 1 is gathered whole (Swin's shifted-window mask, ``view(n // per, per,
        # ...)`` with one sample, left its windows replicated and the next ``attn @ v`` refused).
        priority = (outer != 1, size == 1 < rows, outer not in merged_before,
                    not (candidate >= dim and list(target[:dim]) == list(virtual[:dim])))
        if after % rest == 0:  # the rows stay rows, possibly merged with whole dims after (and before) them
            if after // rest in merged_after and size * rest == outer * rows * after:
                found.append((priority, candidate, Placement(candidate, after, rest, outer)))
        elif rest % after == 0 and outer == 1:  # a run of tokens split into (rows, W)
            if any((n * after) % rest for n in sizes):
                misaligned = misaligned or NeedsAlignment(candidate, rest // math.gcd(rest, after))
            elif size * rest == rows * after:
                found.append((priority, candidate, Placement(candidate, after, rest, 1)))
    if found:
        best = found[0]
        for f in found[1:]:  # NOTE: a loop, not min(key=...): Dynamo traces this planner and refuses that call
            if (f[0], f[1]) < (best[0], best[1]):
                best = f
        return best[2]
    if misaligned is not None:
        raise misaligned
    return None


def aligned_to(sizes: tuple[int, ...], unit: int) -> tuple[int, ...]:
    """``sizes`` with every boundary between ranks moved to the nearest multiple of ``unit`` (the total unchanged).

    Usage: ``aligned_to((5, 6, 5), 4)  # (4, 8, 4)``
    """
    total, bounds, at = sum(sizes), [0], 0
    for n in sizes[:-1]:
        at += n
        bounds.append(max(bounds[-1], min(total - total % unit, unit * round(at / unit))))
    bounds.append(total)
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _in_windows(virtual: tuple[int, ...], at: int, target: list[int],
                sizes: tuple[int, ...]) -> tuple[Placement, int] | None:
    """A placement of the rows seen as ``(rows // unit, unit)`` windows (``unit`` a target size dividing the rows),
    the window index the sharded dim: MobileViT's ``reshape(B * C * H // ph, ph, W // pw, pw)``. Every rank's rows
    are then first moved to whole windows (``aligned_to``), so no window straddles two ranks."""
    rows = virtual[at]
    for unit in sorted({t for t in target if 1 < t < rows and rows % t == 0}):
        windows = (*virtual[:at], rows // unit, unit, *virtual[at + 1:])
        try:
            placed = place_rows(windows, at, target, tuple(n // unit for n in aligned_to(sizes, unit)))
        except NeedsAlignment:
            continue
        if placed is not None:
            return placed, unit
    return None


def reshaped(x: DomainTensor, target: list[int], op_name: str, view: bool) -> Step:
    """``x`` reshaped to the global ``target`` when the ranks' results concatenate to the one-process one; else a refusal.

    Usage: ``reshaped(xs, [b, c, h, w], "torch.reshape", view=False)``

    A split of the rows into whole windows (Swin's ``view(B, H // ws, ws, ...)``) that some rank's run would cut
    first moves the rank boundaries to whole windows (the fewest rows travel): no window straddles two ranks.
    """
    spec = x.spec
    whole = tuple(size_of(x))
    if math.prod(target) != math.prod(whole):
        raise RuntimeError(f"{op_name}: shape {list(target)} is invalid for input of size {math.prod(whole)}")
    d, rows = spec.dim, sum(spec.sizes)
    virtual = (*whole[:d], spec.outer, rows, *whole[d + 1:]) if spec.outer > 1 else whole
    at = d + 1 if spec.outer > 1 else d
    sizes, source = spec.sizes, x
    try:
        placed = place_rows(virtual, at, target, sizes)
    except NeedsAlignment as need:
        if spec.outer > 1:
            raise NotImplementedError(
                f"{op_name}{tuple(target)}: the rows of a strided layout would have to move to whole target rows of "
                f"{need.unit}; reshape back to the unstrided shape first, or call .full_tensor()") from None
        sizes = aligned_to(sizes, need.unit)
        source = Resplit(x, sizes)
        placed = place_rows(virtual, at, target, sizes)
    if placed is None and spec.outer == 1:  # rows split into whole windows merged with the dims before (MobileViT)
        split = _in_windows(virtual, at, target, sizes)
        if split is not None:
            placed, unit = split
            sizes = aligned_to(spec.sizes, unit)
            source = Resplit(x, sizes) if sizes != spec.sizes else x
            sizes = tuple(n // unit for n in sizes)
    if placed is None:
        raise NotImplementedError(
            f"{op_name}{tuple(target)} of a domain tensor of shape {whole} sharded along dim {d} would mix "
            "rows of the sharded dim with other dims; reshape only dims other than the sharded one (or merge it "
            "with whole dims before or after it), or call .full_tensor() first"
        )
    new_sizes = placed.sizes(sizes)
    local_target = list(target)
    local_target[placed.dim] = placed.outer * new_sizes[spec.comm.index]
    out = DomainSpec(placed.dim, new_sizes, spec.comm, placed.outer)
    return Step((lambda t: t.view(local_target)) if view else (lambda t: t.reshape(local_target)), (source,), out=out)


def _reshape_rule(op_name: str, view: bool):
    def rule(x: DomainTensor, *shape) -> Step:
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise NotImplementedError(f"{op_name}(dtype) on a domain-sharded tensor is not supported; call .to_local()")
        step = reshaped(x, target_shape(shape, math.prod(size_of(x))), op_name, view)
        if any(isinstance(a, Resplit) for a in step.args):
            # NOTE: rows moved to whole windows first: the result is a copy, not an alias of x (a view's writes are
            # refused; a reshape's result is a tensor of its own, as torch's reshape may copy)
            return mark_copied_view(run_step(step), x, op_name) if view else made_as_copy(run_step(step))
        return step

    return rule


register(torch.Tensor.view)(_reshape_rule("torch.Tensor.view", view=True))
register(torch.reshape, torch.Tensor.reshape)(_reshape_rule("torch.reshape", view=False))


@register(torch.flatten, torch.Tensor.flatten)
def _flatten(x: DomainTensor, start_dim: int = 0, end_dim: int = -1) -> Step | DomainTensor:
    """A reshape merging dims [start, end]: fine when the sharded dim is outside them or is their first."""
    shape = list(size_of(x))
    if not shape:
        return x
    start, end = start_dim % len(shape), end_dim % len(shape)
    target = [*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:]]
    return reshaped(x, target, f"torch.flatten(start_dim={start_dim}, end_dim={end_dim}) ->", view=False)

