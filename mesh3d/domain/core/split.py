"""The one split rule for domain-sharded tensors: how a global length is cut into per-rank sizes.

Usage::

    from mesh3d.domain.core.split import split_sizes
    split_sizes(10, 4)                 # (3, 3, 3, 1)  -- torch.chunk's sizes
    split_sizes(9, 4)                  # (3, 3, 3, 0)  -- torch.chunk gives 3 chunks; rank 3 holds an empty shard
    split_sizes(10, 4, (4, 1, 1, 4))   # explicit sizes are checked and returned

The default is exactly ``torch.chunk``'s layout (also DTensor's), so a shard made here matches a
``torch.chunk``/DTensor shard of the same tensor. Where ``torch.chunk`` returns fewer chunks than
ranks, the missing ranks hold empty shards (every op here accepts them); pass ``sizes=`` for a
balanced layout instead (``balanced_sizes`` computes one).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["aligned_sizes", "balanced_sizes", "offsets_of", "split_sizes"]


def split_sizes(length: int, parts: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per-rank sizes of ``length`` over ``parts`` ranks: ``torch.chunk``'s, or ``sizes`` checked.

    Usage: ``split_sizes(10, 4)  # (3, 3, 3, 1); split_sizes(10, 2, (7, 3)) checks explicit sizes``
    """
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"the domain must have at least one rank; got parts={parts!r}")
    if length < 0:
        raise ValueError(f"cannot split a negative length {length}")
    if sizes is None:
        if length == 0:
            return (0,) * parts
        chunk = -(-length // parts)  # ceil, as torch.chunk does
        return tuple(max(0, min(chunk, length - i * chunk)) for i in range(parts))
    sizes = tuple(sizes)
    if len(sizes) != parts or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in sizes):
        raise ValueError(
            f"sizes={sizes!r} must be {parts} non-negative ints (one per domain rank); "
            f"e.g. sizes={balanced_sizes(length, parts)!r}"
        )
    if sum(sizes) != length:
        raise ValueError(
            f"sizes={sizes!r} sum to {sum(sizes)} but the sharded dim has length {length}; "
            f"e.g. sizes={balanced_sizes(length, parts)!r}"
        )
    return sizes


def balanced_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Sizes differing by at most one, larger first (no empty shard while length >= parts).

    Usage: ``balanced_sizes(10, 4)  # (3, 3, 2, 2)``
    """
    base, extra = divmod(length, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def offsets_of(sizes: Sequence[int]) -> tuple[int, ...]:
    """Global start index of each rank's shard."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


def aligned_sizes(length: int, parts: int, multiple_of: int) -> tuple[int, ...]:
    """Sizes where every rank's size but the last is a multiple of ``multiple_of`` (as balanced as that allows).

    Usage: ``aligned_sizes(32, 3, 16)  # (16, 16, 0); aligned_sizes(40, 3, 8)  # (16, 16, 8)``

    A model that downsamples the sharded dim by m (four 2x poolings: m = 16) and compares local
    shapes (a decoder padding a skip to match) then sees on every rank the shapes one process sees.
    """
    if not isinstance(multiple_of, int) or isinstance(multiple_of, bool) or multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int (the model's downsampling factor)")
    units, rest = divmod(length, multiple_of)
    sizes = [u * multiple_of for u in balanced_sizes(units, parts)]
    sizes[-1] += rest
    return tuple(sizes)
