"""``view``/``reshape``/``flatten`` of a domain tensor: allowed when they split or merge only dims other than the sharded one.

Attention code reshapes ``(B, T, heads*hd)`` into ``(B, T, heads, hd)`` and back, with ``T`` the local
sequence length (``.shape`` is the local shape). Such a reshape keeps every row of the sharded dim a
row of one target dim, with the same dims before it (by element count), the row possibly merged with
whole dims after it (as ``flatten`` does): then the global reshape is exactly the concatenation of the
local ones. A reshape that would mix rows of the sharded dim with the dims before it is refused.

Usage (through torch; nothing to call)::

    q = q_proj(x).view(b, t, heads, hd).transpose(1, 2)   # x sharded along dim 1 → q along dim 2
"""

from __future__ import annotations

import math

import torch

from mesh3d.domain.registry import register
from mesh3d.domain.step import Step
from mesh3d.domain.tensor import DomainTensor, unwrap

__all__ = ["reshaped"]


def _target_shape(args: tuple, local: torch.Tensor, dim: int) -> list[int]:
    shape = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)
    if not all(isinstance(s, int) for s in shape):
        raise NotImplementedError(f"view/reshape of a domain tensor needs a shape of ints, got {args!r}")
    if shape.count(-1) == 1:
        at = shape.index(-1)
        known = math.prod(s for s in shape if s != -1)
        if local.numel():
            shape[at] = local.numel() // known if known else 0
        elif 0 in shape:
            # An empty shard, its 0 rows named explicitly (reshape(b, t, -1) with t = 0): the -1 is what
            # it is on every other rank, the elements per row, which torch cannot infer from 0 elements.
            rest = math.prod(n for i, n in enumerate(local.shape) if i != dim)
            shape[at] = rest // math.prod(s for s in shape if s not in (-1, 0))
        else:
            shape[at] = 0  # the -1 is the dim that holds the (no) rows: reshape(b, c, -1) merging them
    return shape


def _sharded_dim_after(local: tuple[int, ...], dim: int, target: list[int],
                       sizes: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(target dim holding the sharded rows, elements per row before, elements per target row), or None.

    With the same element count before it, target dim ``c`` holds the rows when each rank's block of
    ``n_r * after`` elements (per index of the dims before) is whole target rows of ``rest`` elements:
    then the global reshape is the concatenation of the local ones. This covers keeping the rows,
    merging them with whole dims after (``flatten``), and splitting a token run into (rows, W) (the
    inverse of ``flatten(2)``) when every rank's run is whole rows. Every rank decides from the
    global ``sizes``; an empty shard finds the same dim as the others. With dims of size 1 next to a
    shard of length 1 the first fitting target dim is taken. Raises when the run is not whole rows.
    """
    before, after = math.prod(local[:dim]), math.prod(local[dim + 1:])
    merged = {math.prod(local[dim + 1:dim + 1 + k]) for k in range(len(local) - dim)}  # whole trailing dims
    found, whole_rows_missing = [], None
    for candidate, size in enumerate(target):
        rest = math.prod(target[candidate + 1:])
        if math.prod(target[:candidate]) != before or rest == 0:
            continue
        # Prefer targets keeping the dims before the sharded one as they are (a leading 1 is not the rows).
        priority = 0 if candidate >= dim and list(target[:dim]) == list(local[:dim]) else 1
        if after % rest == 0:  # the rows stay rows, possibly merged with whole dims after them
            if after // rest in merged and size * rest == local[dim] * after:
                found.append((priority, candidate, rest))
        elif rest % after == 0:  # a run of tokens split into (rows, W): every rank's run must be whole rows
            if any((n * after) % rest for n in sizes):
                whole_rows_missing = whole_rows_missing or (candidate, rest)
            elif size * rest == local[dim] * after:
                found.append((priority, candidate, rest))
    if found:
        _, candidate, rest = min(found)
        return candidate, after, rest
    if whole_rows_missing is not None:
        candidate, rest = whole_rows_missing
        raise NotImplementedError(
            f"reshape of a domain tensor sharded along dim {dim} with sizes {sizes}: target dim "
            f"{candidate} needs every rank's run ({after} elements per row) to be whole rows of {rest} elements, "
            f"and it is not; shard with sizes that are multiples of {rest // math.gcd(rest, after)} "
            "(domain.redistribute(x, sizes=...)) or call .full_tensor() first"
        )
    return None


def reshaped(x: DomainTensor, target: list[int], op_name: str, view: bool) -> Step:
    """``x`` reshaped to the local ``target`` when the ranks' results concatenate to the global one; else a refusal.

    Usage: ``reshaped(xs, [b, c, h, w], "torch.reshape", view=False)``
    """
    local = unwrap(x)
    found = _sharded_dim_after(tuple(local.shape), x.spec.dim, target, x.spec.sizes)
    if found is None:
        raise NotImplementedError(
            f"{op_name}{tuple(target)} of a domain tensor of local shape {tuple(local.shape)} sharded along dim "
            f"{x.spec.dim} would mix rows of the sharded dim with other dims; reshape only dims other than the "
            "sharded one (use the local sizes from .shape), or call .full_tensor() first"
        )
    new_dim, after, rest = found
    return Step((lambda t: t.view(target)) if view else (lambda t: t.reshape(target)), (x,),
                out=x.spec.with_sizes(tuple(n * after // rest for n in x.spec.sizes), dim=new_dim))


def _reshape_rule(op_name: str, view: bool):
    def rule(x: DomainTensor, *shape) -> Step:
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise NotImplementedError(f"{op_name}(dtype) on a domain-sharded tensor is not supported; call .to_local()")
        return reshaped(x, _target_shape(shape, unwrap(x), x.spec.dim), op_name, view)

    return rule


register(torch.Tensor.view)(_reshape_rule("torch.Tensor.view", view=True))
register(torch.reshape, torch.Tensor.reshape)(_reshape_rule("torch.reshape", view=False))


@register(torch.flatten, torch.Tensor.flatten)
def _flatten(x: DomainTensor, start_dim: int = 0, end_dim: int = -1) -> Step | DomainTensor:
    """A reshape merging dims [start, end]: fine when the sharded dim is outside them or is their first."""
    shape = list(unwrap(x).shape)
    if not shape:
        return x
    start, end = start_dim % len(shape), end_dim % len(shape)
    target = [*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:]]
    return reshaped(x, target, f"torch.flatten(start_dim={start_dim}, end_dim={end_dim}) ->", view=False)
