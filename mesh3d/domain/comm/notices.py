"""Notices to domain peers (stop, failed, lost) posted without waiting: a peer reads each at its next exchange.

Usage::

    NOTICES.keep(works)          # the works of posted notices: held (with their buffers) until they land
    NOTICES.settle()             # at teardown (a DistributedManager.on_teardown hook)
"""

from __future__ import annotations

import time
from datetime import timedelta

from mesh3d.faults.beat import WAITING

__all__ = ["NOTICES", "PendingNotices"]

WAITING.add(__file__)  # NOTE: its frames wait on other ranks (the heartbeat says so: mesh3d/faults/beat.py)


class PendingNotices:
    """Notices to domain peers (stop, failed) posted without waiting: a peer reads them at its next exchange.

    Usage: ``NOTICES.keep(works)``; at teardown ``NOTICES.settle()`` (a ``DistributedManager.on_teardown`` hook)
    """

    def __init__(self) -> None:
        self._works: list = []
        self._abandoned: list = []  # notices no peer took within a settle: held, never waited for again

    def keep(self, works: list) -> None:
        """Hold the posted works (and so their buffers) until they complete."""
        self._works.extend(works)

    @property
    def pending(self) -> int:
        """Notices posted since the last settle and not yet known to have landed."""
        return len(self._works)

    @property
    def abandoned(self) -> int:
        """Notices that no peer took within a settle (held until the process ends)."""
        return len(self._abandoned)

    def settle(self, timeout: timedelta = timedelta(seconds=1)) -> None:
        """Wait, at most ``timeout`` in all, for the notices posted since the last settle to be taken.

        NOTE: gloo cannot cancel a posted send, so a notice no peer took (it left first) stays held until the
        process ends, when its peer's connection is gone too. It is waited for once: a process that builds and
        shuts down meshes again and again (a test pool, a sweep) must not pay ``timeout`` at every shutdown
        for a notice that can no longer land (the peers' drain would wait for it too).
        """
        deadline = time.monotonic() + timeout.total_seconds()
        for work in self._works:
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:
                self._abandoned.append(work)
        self._works = []


#: The process's notices in flight (one domain group per process at a time).
NOTICES = PendingNotices()
