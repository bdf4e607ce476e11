"""A domain peer that is gone: its connection closed during an exchange because its process ended.

A rank killed mid-step (out of memory, the scheduler, ``kill -9``) or ended by an error outside mesh3d closes
its sockets; a survivor waiting for it in an exchange gets gloo's "Connection closed by peer" (no rank in it).
That is not a divergence: the survivor names the lost rank, tells its other domain peers (a ``KIND_LOST``
notice, read as their next header from it, so none waits for the group timeout), and raises
``DomainPeerLostError``. A peer that stays alive but never arrives is a timeout, reported as before.

Usage::

    try:
        loss = model(xs).mean()
    except DomainPeerLostError as err:
        err.lost                       # {global rank: why}, as every PeerLostError
        err.lost_domain_ranks          # the same ranks as indices on the domain axis
"""

from __future__ import annotations

from mesh3d.domain.comm.divergence import recent_ops
from mesh3d.faults import PeerLostError
from mesh3d.faults.attach import WATCH
from mesh3d.faults.errors import WHAT_TO_DO
from mesh3d.faults.watch import closed_connection
from mesh3d.manager import DistributedManager
from mesh3d.faults.beat import WAITING

__all__ = ["DomainPeerLostError", "lost_peers", "peer_lost_error"]

WAITING.add(__file__)  # NOTE: its frames wait on other ranks (the heartbeat says so: mesh3d/faults/beat.py)

class DomainPeerLostError(PeerLostError):
    """A domain peer's process ended during a domain exchange; ``lost_domain_ranks``: its index on the domain axis.

    Usage: ``except PeerLostError as err: print(err.lost, err)  # then end, and restart from a checkpoint``
    """

    def __init__(self, message: str, lost: dict[int, str], lost_domain_ranks: list[int]) -> None:
        super().__init__(message, lost)
        self.lost_domain_ranks = lost_domain_ranks


def lost_peers(works: list, peers: list[int]) -> tuple[list[int], BaseException | None]:
    """Wait for every work; return the peers whose connection closed, and the first such error.

    ``peers[i]`` is the peer of ``works[i]`` (gloo: one work per message). A backend that coalesces the
    messages into fewer works (NCCL) cannot say which peer failed: every peer of the exchange is named then.
    Errors other than a closed connection (a timeout) are raised as they are.
    """
    lost: list[int] = []
    first: BaseException | None = None
    for i, work in enumerate(works):
        try:
            work.wait()  # bounded by the group timeout
        except RuntimeError as err:
            if not closed_connection(err):
                raise
            first = first or err
            lost.extend(peers if len(works) != len(peers) else [peers[i]])
    return sorted(set(lost)), first


def _who(comm, q: int) -> str:
    """``rank r (batch b, domain d, model m)``: as every PeerLostError names a rank."""
    return _who_rank(comm.ranks[q])


def _who_rank(rank: int) -> str:
    return DistributedManager().describe_rank(rank) if DistributedManager.is_initialized() else f"rank {rank}"


def peer_lost_error(comm, lost: list[int], err: BaseException | None, seen_by: int | None = None) -> DomainPeerLostError:
    """The error a survivor raises: who is gone, how this rank learned it, what to do."""
    names = ", ".join(_who(comm, q) for q in lost)
    if seen_by is None:
        how = (f"its connection closed while this rank (domain rank {comm.index}) waited for it in a domain exchange"
               f" ({type(err).__name__}: {str(err).splitlines()[0][:160] if err else ''}). Its process ended: killed "
               "(out of memory, the scheduler, a signal) or an error outside mesh3d")
    else:
        how = (f"domain rank {seen_by} saw its connection close in a domain exchange and told this rank "
               f"(domain rank {comm.index})")
    gone = {comm.ranks[q]: "its connection closed in a domain exchange" for q in lost}
    # NOTE: a survivor blocked in a collective with a lost rank ends its own process (mesh3d/faults/watch.py), and its
    # domain peers then see its connection close: the rank lost first is the cause, named first (and in ``lost``).
    before = {r: why for r, why in WATCH.current.known_lost().items() if r not in gone}
    cause = "".join(f" Lost before it: {_who_rank(r)}, {why}." for r, why in sorted(before.items()))
    return DomainPeerLostError(f"{names} is gone: {how}.{cause} {WHAT_TO_DO} Latest here:\n{recent_ops()}",
                               {**before, **gone}, lost)

