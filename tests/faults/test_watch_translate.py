"""What a survivor's raw collective failure becomes (``PeerWatch.translate``), on watches of one store in one process.

The case that CI met once (fault family async/hang): a survivor's peer timed out first and gloo closed that pair, so
the survivor read "Connection closed by peer [127.0.0.1]:port" with every process alive. It must name the hang as a
timeout does, not pass on a port number.
"""

from __future__ import annotations

import torch.distributed as dist

from mesh3d import CollectiveTimeoutError, WatchSettings
from mesh3d.faults.watch import PeerWatch

CLOSED = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:11425")


_STORES: list[dist.Store] = []  # NOTE: the server lives as long as its master object: kept for the module's tests


def _watches(world: int) -> list[PeerWatch]:
    _STORES.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    return [PeerWatch(_STORES[-1].clone(), r, world, lambda r: f"rank {r} (batch {r})", WatchSettings())
            for r in range(world)]


def test_a_live_peer_that_closed_its_connection_is_told_as_a_timeout_naming_the_rank_not_waiting():
    watches = _watches(3)
    for rank, watch in enumerate(watches[1:], start=1):
        with watch.doing("checkpoint: saving ck" if rank == 1 else "cell async/hang"):
            watch._beat()  # a heartbeat as the watch thread writes it: this thread is not in a collective
    named = watches[0].translate(CLOSED)
    assert isinstance(named, CollectiveTimeoutError), named
    text = str(named)
    assert text.startswith("a peer gave up on a collective"), text
    assert "Connection closed by peer" in text  # what gloo said stays in the message
    for rank in (1, 2):
        assert f"rank {rank} (batch {rank}): " in text, text
    assert "cell async/hang" in text and "the likely hang" in text, text


def test_a_closed_connection_with_a_peer_known_lost_names_the_lost_peer():
    watches = _watches(2)
    watches[0].lost[1] = "its heartbeat stopped"
    named = watches[0].translate(CLOSED)
    assert type(named).__name__ == "PeerLostError" and "rank 1 (batch 1)" in str(named), named


def test_an_error_not_about_peers_passes_through():
    err = RuntimeError("expected scalar type Float but found Double")
    assert _watches(2)[0].translate(err) is err
