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

import torch

from mesh3d.domain.registry import register
from mesh3d.domain.step import Step
from mesh3d.domain.tensor import DomainTensor

__all__ = ["reshaped", "target_shape"]


def target_shape(args: tuple, numel: int) -> list[int]:
    """The target shape of ``view(*args)``/``reshape(*args)`` of a tensor of ``numel`` elements (``-1`` inferred).

    Usage: ``target_shape((b, -1, c), xs.numel())``
    """
    shape = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)
    if not all(isinstance(s, int) for s in shape):
        raise NotImplementedError(f"view/reshape of a domain tensor needs a shape of ints, got {args!r}")
    if shape.count(-1) > 1:
        raise RuntimeError(f"only one dimension can be inferred (shape {tuple(shape)})")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or numel % known:
            raise RuntimeError(f"shape {list(shape)} is invalid for input of size {numel}")
        shape[shape.index(-1)] = numel // known
    elif known != numel:
        raise RuntimeError(f"shape {list(shape)} is invalid for input of size {numel}")
    return shape


def _sharded_dim_after(whole: tuple[int, ...], dim: int, target: list[int],
                       sizes: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(target dim holding the sharded rows, elements per row before, elements per target row), or None.

    ``whole`` and ``target`` are global shapes.

    With the same element count before it, target dim ``c`` holds the rows when each rank's block of
    ``n_r * after`` elements (per index of the dims before) is whole target rows of ``rest`` elements:
    then the global reshape is the concatenation of the local ones. This covers keeping the rows,
    merging them with whole dims after (``flatten``), and splitting a token run into (rows, W) (the
    inverse of ``flatten(2)``) when every rank's run is whole rows. Every rank decides from the
    global ``sizes``; an empty shard finds the same dim as the others. With dims of size 1 next to a
    shard of length 1 the first fitting target dim is taken. Raises when the run is not whole rows.
    """
    before, after = math.prod(whole[:dim]), math.prod(whole[dim + 1:])
    merged = {math.prod(whole[dim + 1:dim + 1 + k]) for k in range(len(whole) - dim)}  # whole trailing dims
    found, whole_rows_missing = [], None
    for candidate, size in enumerate(target):
        rest = math.prod(target[candidate + 1:])
        if math.prod(target[:candidate]) != before or rest == 0:
            continue
        # Prefer targets keeping the dims before the sharded one as they are (a leading 1 is not the rows).
        priority = 0 if candidate >= dim and list(target[:dim]) == list(whole[:dim]) else 1
        if after % rest == 0:  # the rows stay rows, possibly merged with whole dims after them
            if after // rest in merged and size * rest == whole[dim] * after:
                found.append((priority, candidate, rest))
        elif rest % after == 0:  # a run of tokens split into (rows, W): every rank's run must be whole rows
            if any((n * after) % rest for n in sizes):
                whole_rows_missing = whole_rows_missing or (candidate, rest)
            elif size * rest == whole[dim] * after:
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
    """``x`` reshaped to the global ``target`` when the ranks' results concatenate to the one-process one; else a refusal.

    Usage: ``reshaped(xs, [b, c, h, w], "torch.reshape", view=False)``
    """
    spec = x.spec
    whole = tuple(x.shape)
    if math.prod(target) != math.prod(whole):
        raise RuntimeError(f"{op_name}: shape {list(target)} is invalid for input of size {math.prod(whole)}")
    found = _sharded_dim_after(whole, spec.dim, target, spec.sizes)
    if found is None:
        raise NotImplementedError(
            f"{op_name}{tuple(target)} of a domain tensor of shape {whole} sharded along dim {spec.dim} would mix "
            "rows of the sharded dim with other dims; reshape only dims other than the sharded one (or merge it "
            "with whole dims after it), or call .full_tensor() first"
        )
    new_dim, after, rest = found
    sizes = tuple(n * after // rest for n in spec.sizes)
    local_target = list(target)
    local_target[new_dim] = sizes[spec.comm.index]
    return Step((lambda t: t.view(local_target)) if view else (lambda t: t.reshape(local_target)), (x,),
                out=spec.with_sizes(sizes, dim=new_dim))


def _reshape_rule(op_name: str, view: bool):
    def rule(x: DomainTensor, *shape) -> Step:
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise NotImplementedError(f"{op_name}(dtype) on a domain-sharded tensor is not supported; call .to_local()")
        return reshaped(x, target_shape(shape, x.numel()), op_name, view)

    return rule


register(torch.Tensor.view)(_reshape_rule("torch.Tensor.view", view=True))
register(torch.reshape, torch.Tensor.reshape)(_reshape_rule("torch.reshape", view=False))


@register(torch.flatten, torch.Tensor.flatten)
def _flatten(x: DomainTensor, start_dim: int = 0, end_dim: int = -1) -> Step | DomainTensor:
    """A reshape merging dims [start, end]: fine when the sharded dim is outside them or is their first."""
    shape = list(x.shape)
    if not shape:
        return x
    start, end = start_dim % len(shape), end_dim % len(shape)
    target = [*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:]]
    return reshaped(x, target, f"torch.flatten(start_dim={start_dim}, end_dim={end_dim}) ->", view=False)
