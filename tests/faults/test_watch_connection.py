"""Peer watches share one store connection per process while each ends sound (CurrentWatch.connection's NOTE: a new
connection can stall 5 s on a reverse DNS lookup), and get a new one whenever reuse could be wrong."""

from __future__ import annotations

import sys

import torch.distributed as dist

from mesh3d import WatchSettings
from mesh3d.faults.attach import CurrentWatch
from mesh3d.faults.watch import PeerWatch


def _watch(connection: dist.Store) -> PeerWatch:
    return PeerWatch(connection, 0, 2, lambda r: f"rank {r}", WatchSettings())


def test_watches_share_one_store_connection_while_each_ends_sound(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # install() chains it once per slot
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    slot = CurrentWatch()
    first = slot.connection(store)
    assert first is not store  # a client of its own, never behind the main thread's store calls
    slot.install(_watch(first))
    slot.clear()  # a clean shutdown: done, nobody lost, every store call answered
    second = slot.connection(store)
    assert second is first

    slot.install(_watch(second))
    assert slot.connection(store) is not second  # a watch still current: never shared
    failed_connection = slot.connection(store)
    failed = _watch(failed_connection)
    slot.install(failed)
    failed.report_failure(RuntimeError("a step failed"))
    slot.clear()
    after_failure = slot.connection(store)
    assert after_failure is not failed_connection  # a failed watch's connection is not reused
    slot.install(_watch(after_failure))
    slot.clear()
    assert slot.connection(store) is after_failure

    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert slot.connection(other) is not after_failure  # another job's store: a client of that one
