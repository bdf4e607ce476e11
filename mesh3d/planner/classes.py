"""Domain ranks that behave alike, so a plan simulates one rank per class instead of every rank.

A domain rank's step depends on its own rows and on the rows of the peers it exchanges with. Window ops
give each rank the outputs whose window centre lies in its rows, so the offsets of a rank's outputs are a
function of its own offset: two ranks whose offsets agree modulo the model's downsampling factor and whose
sizes agree get the same output sizes at every layer. Their exchanges then match when the peers they
exchange with (within ``radius`` grid steps, cyclically: circular padding wraps) hold the same sizes, and
their distances to the grid's edges (clipped at ``radius``) agree. Exchanges with every peer (gathers,
reductions) depend on the rank's own size and the global sizes only. ``DomainClasses`` keys ranks that way
and grows ``radius`` until no simulated rank exchanged with a peer farther away.

Usage::

    classes = DomainClasses(grid=(4, 4), sizes=((64,) * 4, (64,) * 4), factors=(8, 8))
    reps = classes.representatives(radius=1)      # {key: first domain index}; classes.members(key)
"""

from __future__ import annotations

import math

from mesh3d.domain.core.specs import grid_coords
from mesh3d.domain.core.split import offsets_of

__all__ = ["DomainClasses"]


class DomainClasses:
    """Groups of domain indices that behave alike (see the module docstring)."""

    def __init__(self, grid: tuple[int, ...], sizes: tuple[tuple[int, ...], ...], factors: tuple[int | None, ...]) -> None:
        self.grid, self.sizes, self.factors = grid, sizes, factors
        self.radius = 1
        self._keys: list[tuple] = []

    def _dim_key(self, k: int, c: int, radius: int) -> tuple:
        n, sizes = self.grid[k], self.sizes[k]
        offset = offsets_of(sizes)[c]
        factor = self.factors[k]
        where = offset if factor is None else offset % factor  # None: the model's factor is unknown, every offset counts
        around = tuple(sizes[(c + j) % n] for j in range(-radius, radius + 1))
        return min(c, radius), min(n - 1 - c, radius), where, around

    def keys(self, radius: int) -> list[tuple]:
        """One key per domain index (row-major over the grid)."""
        self.radius = radius
        self._keys = [tuple(self._dim_key(k, c, radius) for k, c in enumerate(grid_coords(d, self.grid)))
                      for d in range(math.prod(self.grid))]
        return self._keys

    def representatives(self, radius: int) -> dict[tuple, int]:
        """{key: the first domain index with it} at ``radius``."""
        reps: dict[tuple, int] = {}
        for d, key in enumerate(self.keys(radius)):
            reps.setdefault(key, d)
        return reps

    def class_of(self) -> list[int]:
        """For each domain index, the index of its class's representative (at the last radius asked for)."""
        first: dict[tuple, int] = {}
        return [first.setdefault(key, d) for d, key in enumerate(self._keys)]
