"""Starting the peer watch for a mesh, and telling the peers when this process ends with an uncaught error.

Usage (``DistributedManager.initialize`` does this)::

    watch = start_watch(rank, world_size, settings, describe)   # before the mesh's collectives
    ...build the mesh...
    watch.begin(peers)                                           # after them: every peer has beaten once
    WATCH.current = watch                                        # what checkpoint, data and domain code check
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.distributed as dist

from mesh3d._torch_private import default_store
from mesh3d.faults.watch import NO_WATCH, PeerWatch, WatchSettings

__all__ = ["WATCH", "start_watch"]


class CurrentWatch:
    """The process's current watch (``NO_WATCH`` without a manager); an uncaught exception is reported to it.

    Usage: ``WATCH.current.check()`` before waiting on peers; ``with WATCH.current.doing("checkpoint save"): ...``
    """

    def __init__(self) -> None:
        self.current = NO_WATCH
        self._hooked = False
        self._connection: tuple[dist.Store, dist.Store] | None = None  # (the job's store, the watches' client)
        self._last_sound = False

    def connection(self, store: dist.Store) -> dist.Store:
        """A client of ``store`` for watches alone: the last watch's when it ended sound on the same store.

        NOTE: a new client is a new TCP connection, and c10d names each connection's peer by a reverse DNS lookup
        (client and server side; ``::ffff:127.0.0.1`` is in no hosts file). Where the resolver drops a packet it
        waits 5 s: measured in this sandbox, a quarter of 8-rank ``initialize`` calls stalled 5 s on it. One client
        per process for every mesh on the job's store avoids all but the first (docs/troubleshooting.md).
        """
        if self._connection is not None and self._connection[0] is store and self._last_sound \
                and self.current is NO_WATCH:
            return self._connection[1]
        client = store.clone()  # type: ignore[attr-defined]  # its own connection: never behind the main thread
        self._connection = (store, client)
        return client

    def install(self, watch) -> None:
        """Make ``watch`` current, and chain ``sys.excepthook`` once per process to report to it."""
        self.current = watch
        if not self._hooked:
            sys.excepthook = _ExceptHook(self, sys.excepthook)
            self._hooked = True

    def clear(self) -> None:
        """Stop the current watch (its last beat says "done": the peers do not count this rank lost)."""
        self.current.stop()
        self._last_sound = self.current.ended_sound()
        self.current = NO_WATCH


def start_watch(rank: int, world_size: int, settings: WatchSettings, describe: Callable[[int], str]):
    """A ``PeerWatch`` on the default group's store; ``NO_WATCH`` for a world of one, no store, or interval 0."""
    store = default_store() if world_size > 1 and settings.enabled else None
    if store is None:
        return NO_WATCH
    return PeerWatch(WATCH.connection(store), rank, world_size, describe, settings)


class _ExceptHook:
    """``sys.excepthook`` that first marks this rank failed in its heartbeat, then reports as before."""

    def __init__(self, slot: CurrentWatch, previous) -> None:
        self.slot, self.previous = slot, previous

    def __call__(self, kind, value, tb) -> None:
        try:
            self.slot.current.report_failure(value)
        finally:
            self.previous(kind, value, tb)


#: The process's current watch.
WATCH = CurrentWatch()
