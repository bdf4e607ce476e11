"""The rule that turns requested axis sizes into a (batch, domain, model) mesh shape.

Pure arithmetic on the world size: it runs before any collective, so every rank
reaches the same verdict and a bad request fails everywhere instead of hanging.

Usage::

    resolve_mesh_shape(8, batch=2, domain=2, model=-1)   # (2, 2, 2)
"""

from __future__ import annotations

import math

__all__ = ["AXES", "divisors", "grid_factorizations", "resolve_domain_grid", "resolve_mesh_shape"]

#: The mesh axes, always all three and always in this (row-major) order.
AXES: tuple[str, str, str] = ("batch", "domain", "model")


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name}={size}" for name, size in sizes.items())


def _fixes(world_size: int, sizes: dict[str, int]) -> list[str]:
    """For each axis, the value that would make the product equal the world size."""
    fixes = []
    for name in AXES:
        others = math.prod(size for other, size in sizes.items() if other != name)
        if world_size % others == 0:
            fixes.append(f"{name}={world_size // others}")
    return fixes


def resolve_mesh_shape(world_size: int, batch: int = -1, domain: int = 1, model: int = 1) -> tuple[int, int, int]:
    """Validate axis sizes against the world size and infer the one given as -1.

    Usage: ``resolve_mesh_shape(8, batch=-1, domain=2, model=2)  # (2, 2, 2)``

    Raises ``ValueError`` naming the sizes, the world size and sizes that would work.
    """
    sizes = {"batch": batch, "domain": domain, "model": model}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"{name}={size!r} is not an integer; axis sizes are positive integers, or -1 to infer one")
        if size != -1 and size < 1:
            raise ValueError(
                f"{name}={size} is not a valid axis size for world size {world_size}: use a positive integer "
                f"(a divisor of {world_size}: {', '.join(map(str, divisors(world_size)))}), or -1 to infer it"
            )
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(
            f"{' and '.join(f'{n}=-1' for n in inferred)}: at most one axis size may be -1 (inferred from world size "
            f"{world_size}); give the others explicitly, e.g. batch=-1, domain=1, model=1"
        )
    valid = ", ".join(map(str, divisors(world_size)))
    for name, size in sizes.items():
        if size != -1 and world_size % size != 0:
            others = _fmt({n: s for n, s in sizes.items() if n != name})
            raise ValueError(
                f"{name}={size} does not divide world size {world_size}; valid {name} sizes are the divisors of "
                f"{world_size}: {valid} (requested {others})"
            )
    if inferred:
        name = inferred[0]
        known = math.prod(size for size in sizes.values() if size != -1)
        if world_size % known != 0:
            raise ValueError(
                f"cannot infer {name}: {_fmt({n: s for n, s in sizes.items() if n != name})} use {known} ranks per "
                f"{name} slice, which does not divide world size {world_size}; choose sizes whose product divides "
                f"{world_size} (each a divisor of {world_size}: {valid})"
            )
        sizes[name] = world_size // known
    product = math.prod(sizes.values())
    if product != world_size:
        fixes = _fixes(world_size, sizes)
        hint = f"; with the other two unchanged, use {' or '.join(fixes)}" if fixes else ""
        raise ValueError(
            f"{_fmt(sizes)} make a mesh of {product} ranks, which does not match world size {world_size}{hint}; "
            f"or pass -1 for one axis to infer it"
        )
    return sizes["batch"], sizes["domain"], sizes["model"]


def grid_factorizations(size: int, max_dims: int = 3) -> list[tuple[int, ...]]:
    """Every ordered grid of 1 to ``max_dims`` dims (each > 1, or the single size) whose product is ``size``.

    Usage: ``grid_factorizations(4)  # [(4,), (2, 2)]``
    """
    out: list[tuple[int, ...]] = [(size,)]
    frontier = [(d, size // d) for d in divisors(size) if 1 < d < size]
    for dims in range(2, max_dims + 1):
        nxt = []
        for *head, rest in frontier:
            out.append((*head, rest))
            if dims < max_dims:
                nxt += [(*head, d, rest // d) for d in divisors(rest) if 1 < d < rest]
        frontier = nxt
    return out


def resolve_domain_grid(world_size: int, batch: int, domain: int | tuple[int, ...], model: int) -> tuple[int, tuple[int, ...]]:
    """The domain axis size and its grid: ``domain=4`` is the 1-D grid (4,), ``domain=(2, 2)`` a 2x2 grid of blocks.

    Usage: ``resolve_domain_grid(8, batch=2, domain=(2, 2), model=1)  # (4, (2, 2))``

    A grid's product is the domain size; when it does not fit the world, the error names the grids that would.
    """
    if isinstance(domain, int):
        return domain, (domain,)
    grid = tuple(domain) if isinstance(domain, (tuple, list)) else None
    if not grid or len(grid) > 3 or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid):
        raise ValueError(f"domain={domain!r}: a domain grid is a tuple of 1 to 3 positive sizes, e.g. domain=(2, 2); "
                         "or pass one integer for slabs")
    size = math.prod(grid)
    try:
        resolve_mesh_shape(world_size, batch, size, model)
    except ValueError as err:
        try:
            fitting = resolve_mesh_shape(world_size, batch, -1, model)[1] if -1 not in (batch, model) else None
        except ValueError:
            fitting = None
        hint = (f"; grids of the {fitting} domain ranks that fit: "
                f"{', '.join(map(str, grid_factorizations(fitting)))}") if fitting else ""
        raise ValueError(f"domain grid {grid} has {size} ranks, which does not fit: {err}{hint}") from None
    return size, grid
