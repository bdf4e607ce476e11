"""pytest plugin: the session-wide ``ranks`` fixture over one RankPool per world size.

Usage in a test module::

    def _body(n):                      # module level, runs on every rank
        ...
        return value

    def test_something(ranks):
        results = ranks.run(4, _body, 3)   # list of 4 results, by rank
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rankpool.pool import DEFAULT_TIMEOUT_S, RankPool

#: The world sizes the suite uses; others work too but cost a pool each.
WORLD_SIZES = (1, 2, 4, 8)


class RankPools:
    """Lazily started pools, one per world size, shared by the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
            fresh: bool = False, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on each of ``world_size`` ranks (``fresh``: new processes); the per-rank results."""
        return self.pool(world_size).run(fn, *args, timeout=timeout, fresh=fresh, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
            pool.remove_logs()
        self._pools.clear()


@pytest.fixture(scope="session")
def ranks() -> Iterator[RankPools]:
    """Session-wide pools of live gloo ranks; see tests/README.md."""
    # Ranks inherit this before torch starts its thread pools in each fork.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pools = RankPools()
    yield pools
    pools.close()
