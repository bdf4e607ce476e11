"""Faults: a lost or hung rank named on every survivor (mesh3d/faults/watch.py).

Usage::

    dm = DistributedManager.initialize(batch=-1, watch=WatchSettings(dead_after=30))
    with dm.guard("train step"):
        train_step(batch)          # a lost peer raises PeerLostError; a hang, CollectiveTimeoutError
"""

from mesh3d.faults.errors import PEER_LOST_EXIT_CODE, CollectiveTimeoutError, PeerLostError
from mesh3d.faults.watch import PeerWatch, WatchSettings

__all__ = ["PEER_LOST_EXIT_CODE", "CollectiveTimeoutError", "PeerLostError", "PeerWatch", "WatchSettings"]
