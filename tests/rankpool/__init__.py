"""mesh3d's multi-rank test harness: a pool of live gloo ranks per world size.

See tests/README.md for how to write a multi-rank test.
"""

from rankpool.pool import DEFAULT_TIMEOUT_S, RankFailure, RankPool, RankTimeout, forkserver_context

__all__ = ["DEFAULT_TIMEOUT_S", "RankFailure", "RankPool", "RankTimeout", "forkserver_context"]
