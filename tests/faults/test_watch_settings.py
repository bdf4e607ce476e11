"""The peer watch's settings are checked before anything starts, and a world of one has no watch to pay for."""

from __future__ import annotations

import pytest

from mesh3d import DistributedManager, WatchSettings
from mesh3d.faults.beat import ALIVE, Beat, main_thread_where


def test_settings_refuse_what_cannot_work(monkeypatch):
    with pytest.raises(ValueError, match="2 \\* interval <= suspect_after <= dead_after"):
        WatchSettings(interval=2, suspect_after=3)
    with pytest.raises(ValueError, match="grace=-1 must be a number of seconds >= 0"):
        WatchSettings(grace=-1)
    monkeypatch.setenv("MESH3D_HEARTBEAT", "soon")
    with pytest.raises(ValueError, match="MESH3D_HEARTBEAT='soon' must be a number of seconds"):
        WatchSettings.from_env()
    monkeypatch.setenv("MESH3D_HEARTBEAT", "2")
    monkeypatch.setenv("MESH3D_PEER_DEAD_AFTER", "30")
    assert WatchSettings.from_env() == WatchSettings(interval=2, suspect_after=6, dead_after=30)
    monkeypatch.setenv("MESH3D_HEARTBEAT", "0")
    assert not WatchSettings.from_env().enabled


def test_a_world_of_one_runs_no_watch_and_guard_passes_errors_unchanged():
    dm = DistributedManager.initialize()
    try:
        assert dm.describe_rank(0) == "rank 0 (batch 0, domain 0, model 0)"
        with pytest.raises(KeyError, match="mine"):
            with dm.guard("a step"):
                raise KeyError("mine")
        assert not dm.watch.lost
    finally:
        DistributedManager.shutdown()


def test_a_heartbeat_round_trips_and_says_where_the_main_thread_is():
    where, waiting = main_thread_where()
    assert "test_watch_settings.py" in where and not waiting
    beat = Beat(seq=4, status=ALIVE, doing="train step", where=where)
    assert Beat.decode(beat.encode()) == beat
    assert beat.describe().startswith("train step, at test_watch_settings.py:")


def _blocked_in_a_halo_exchange():
    """Domain rank 0 enters a conv's halo exchange while rank 1 sleeps; a thread on each rank reads the heartbeat's
    ``main_thread_where`` meanwhile. Rank 1 then joins, so the exchange completes."""
    import threading
    import time

    import torch

    from mesh3d import domain

    dm = DistributedManager.initialize(batch=1, domain=2)
    xs = domain.shard(torch.randn(1, 1, 8, 4), dim=2)
    seen = []
    sampler = threading.Timer(2.0, lambda: seen.append(main_thread_where()))
    sampler.start()
    if dm.axis_rank("domain") == 1:
        time.sleep(4.0)                       # not in any collective: the rank the others wait for
    torch.nn.functional.conv2d(xs, torch.ones(1, 1, 3, 3), padding=1)
    sampler.join()
    DistributedManager.shutdown()
    return seen[0]


def test_a_rank_blocked_in_a_halo_exchange_is_reported_as_waiting(ranks):
    """The waiting places come from the modules themselves (each adds its __file__): rank 0, inside the exchange, is
    waiting; rank 1, asleep in its own code, is not."""
    (where0, waiting0), (where1, waiting1) = ranks.run(2, _blocked_in_a_halo_exchange, timeout=60)
    assert waiting0 and "test_watch_settings.py" in where0 and "in _blocked_in_a_halo_exchange" in where0, where0
    assert not waiting1 and "test_watch_settings.py" in where1, where1
