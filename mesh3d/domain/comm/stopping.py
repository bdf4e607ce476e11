"""How a domain rank that stops mid-exchange leaves its peers: none of them may wait on it until the group timeout.

Usage (``exchange.py``'s header check)::

    finish_matched(comm, outgoing, incoming, matched_peers(theirs, fingerprint, to_peer, from_peer, skip={q}))
    abort(comm, skip={q})                     # every other domain rank reads KIND_ABORT as its next header from us

A peer whose header matched has posted this exchange's data and waits for it: a notice sent in its place would
hang it, so the data goes first and the notice after (``finish_matched``). A peer that is gone is named to the
others with ``KIND_LOST`` (``leave``); both sides of a divergence swap journals for the message (``swap_journals``).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mesh3d.domain.comm import divergence
from mesh3d.domain.comm.notices import NOTICES
from mesh3d.domain.comm.peer_lost import lost_peers
from mesh3d.domain.comm.traffic import dry_run_observer
from mesh3d.domain.core.group import domain_groups
from mesh3d.faults.attach import WATCH
from mesh3d.faults.beat import WAITING
from mesh3d.faults.watch import closed_connection

__all__ = ["ClosedWork", "abort", "finish_matched", "leave", "matched_peers", "post", "report_failure", "swap_journals", "tell_other_groups"]

WAITING.add(__file__)  # NOTE: its frames wait on other ranks (the heartbeat says so: mesh3d/faults/beat.py)


class ClosedWork:
    """The work of a message whose post failed at once because its peer's connection had already closed: its
    ``wait`` raises that error, so the waiter names the peer as gone as it does for a connection that closes later."""

    def __init__(self, err: RuntimeError) -> None:
        self._err = err

    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError(str(self._err))


def post(comm: Any, outgoing: list[tuple[int, torch.Tensor]],
         incoming: list[tuple[int, torch.Tensor]]) -> list:
    """Post every send and receive of ``comm`` (a ``DomainComm``) at once; the works, one per message on gloo."""
    if dry_run_observer() is not None:  # a dry run: nothing is posted (headers and notices included)
        return []
    group = comm.group
    ops = [dist.P2POp(dist.isend, buf, comm.ranks[peer], group) for peer, buf in outgoing]
    ops += [dist.P2POp(dist.irecv, buf, comm.ranks[peer], group) for peer, buf in incoming]
    if not ops:
        return []
    if any(op.tensor.is_cuda for op in ops):  # NOTE: NCCL coalesces the batch into one work
        return dist.batch_isend_irecv(ops)
    # NOTE: gloo posts each message on its own (batch_isend_irecv loops too) and raises at the post itself when the
    # peer's connection closed before it: that message becomes a failed work, and the others are still posted.
    works: list = []
    for op in ops:
        try:
            works.append(op.op(op.tensor, op.peer, op.group, op.tag))
        except RuntimeError as err:
            if not closed_connection(err):
                raise
            works.append(ClosedWork(err))
    return works


def matched_peers(theirs: dict[int, torch.Tensor], fingerprint: int, to_peer: dict[int, int], from_peer: dict[int, int],
             skip: set[int]) -> set[int]:
    """The peers whose header says they will exchange exactly this data (same journal, expected sizes)."""
    return {q for q, h in theirs.items() if q not in skip and divergence.fields(h) == [
        divergence.MAGIC, divergence.KIND_DATA, fingerprint, from_peer.get(q, 0), to_peer.get(q, 0)]}


def finish_matched(comm: Any, outgoing: list[tuple[int, torch.Tensor]],
                    incoming: list[tuple[int, torch.Tensor]], matched: set[int]) -> None:
    """Before this rank stops: finish this exchange's data with ``matched`` peers (they posted it and wait for it; a
    notice sent instead would hang them), so they learn of the stop from the notice that follows, as their next header.
    Data that rode in the headers is not sent again (``divergence.inlined``): nobody waits for it."""
    try:
        lost_peers(post(comm, [(q, b) for q, b in outgoing if q in matched and b.numel() and not divergence.inlined(b)],
                         [(q, b) for q, b in incoming if q in matched and b.numel() and not divergence.inlined(b)]), [])
    except RuntimeError:
        pass  # a peer gone too: the notices still go to everyone left


def leave(comm: Any, outgoing: list[tuple[int, torch.Tensor]], incoming: list[tuple[int, torch.Tensor]],
           matched: set[int], lost: list[int]) -> None:
    """A peer is gone: finish the data with ``matched`` peers, then tell every other domain rank (``KIND_LOST``)."""
    finish_matched(comm, outgoing, incoming, matched)
    notice = divergence.header(divergence.KIND_LOST, min(lost))
    NOTICES.keep(post(comm, [(q, notice) for q in range(comm.size) if q != comm.index and q not in lost], []))
    tell_other_groups(comm, notice)


def swap_journals(comm: Any, peers: list[int], entries: list) -> dict[int, list]:
    """Both sides of a divergence saw it: swap sizes, then the journals themselves (for the message)."""
    data = torch.frombuffer(bytearray(divergence.encode_journal(entries)), dtype=torch.uint8)
    sizes = {q: torch.empty(1, dtype=torch.int64) for q in peers}
    for work in post(comm, [(q, torch.tensor([data.numel()])) for q in peers], list(sizes.items())):
        work.wait()
    bufs = {q: torch.empty(int(sizes[q]), dtype=torch.uint8) for q in peers}
    for work in post(comm, [(q, data) for q in peers if data.numel()],
                      [(q, b) for q, b in bufs.items() if b.numel()]):
        work.wait()
    return {q: json.loads(bytes(b.numpy())) if b.numel() else [] for q, b in bufs.items()}


def abort(comm: Any, skip: set[int]) -> None:
    """Tell every other domain rank to stop: its next header from this rank says so (nobody waits on us)."""
    stop = divergence.header(divergence.KIND_ABORT)
    others = [(q, stop) for q in range(comm.size) if q != comm.index and q not in skip]
    NOTICES.keep(post(comm, others, []))
    tell_other_groups(comm, stop)


def tell_other_groups(comm: Any, notice: torch.Tensor) -> None:
    """Post ``notice`` to every peer of this rank's other domain groups (``domain_groups``), not waiting.

    NOTE: on a domain grid a peer may wait for this rank in an exchange on a grid line's group while this rank stops in
    one on another group; a notice reaches only the group it was posted on, so it goes on each of them. The ranks that
    learn of the stop from it pass it on in turn (``abort``): none waits for the group timeout. A failure notice
    (``KIND_ERROR``) also posts a receive for each peer's answer: its reply when the peer waited for us, or its own
    notice when it failed in the same op (ranks refusing a call together), so no message is left for a later exchange.
    """
    answered = int(notice[1]) == divergence.KIND_ERROR
    for other in sorted(domain_groups(), key=lambda g: g.size):  # the grid lines first: their peers may wait on us
        if other.axis == comm.axis or other.size == 1:
            continue
        peers = [q for q in range(other.size) if q != other.index]
        answers = [(q, torch.empty(divergence.HEADER_WORDS, dtype=torch.int64)) for q in peers] if answered else []
        try:
            NOTICES.keep(post(other, [(q, notice) for q in peers], answers))
        except RuntimeError:  # a peer that left already (its connection closed): the others still hear
            continue


def report_failure(comm: Any, op: str, err: Exception, wait_s: float = 5.0) -> Exception:
    """An op failed on this rank: tell every domain peer (none may wait on us forever) and learn whether
    they ran the same ops. Returns the error to raise: a ``DomainDivergenceError`` when a peer's op journal
    differs (the failure is a symptom of ranks taking different paths), else ``err`` itself.

    Usage: ``reported = report_failure(comm, "torch.nn.functional.conv2d", err); raise reported``

    Ranks that fail together swap these notices and carry on raising at once; a peer waiting for us in an
    exchange answers with its fingerprint; a peer busy elsewhere is given ``wait_s`` seconds.
    """
    WATCH.current.publish_error(err, op)  # before the notice: a peer that reads it can say why we stopped
    fingerprint = divergence.JOURNAL.fingerprint
    notice = divergence.header(divergence.KIND_ERROR, fingerprint)
    others = [q for q in range(comm.size) if q != comm.index]
    # NOTE: zeros, not empty: a reply that never lands must not read as a header (a recycled header's bytes did)
    replies = {q: torch.zeros(divergence.HEADER_WORDS, dtype=torch.int64) for q in others}
    works = post(comm, [(q, notice) for q in others], list(replies.items()))
    deadline = time.monotonic() + wait_s
    landed = 0
    for work in works:  # NOTE: gloo's p2p works report completion only through wait(), which takes a timeout
        try:
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError:  # a peer busy elsewhere: it hears from us at its next exchange with us
            break  # NOTE: no more waits: gloo closes the pair of a wait that timed out
        landed += 1
    # NOTE: only the works not seen to land are held: gloo's wait on a send or receive that has completed waits for a
    # next one, so the teardown's settle timed out on each, and gloo closed the pair ("Application timeout caused
    # pair closure"): every shutdown after ranks refused an op together warned that peers missed its barrier
    NOTICES.keep(works[landed:])
    tell_other_groups(comm, notice)
    heard = _replies_landed(others, works, landed)
    differ = [q for q in heard if _journal_of(replies[q]) not in (None, fingerprint)]
    if not differ:
        return err
    return divergence.DomainDivergenceError(
        f"domain rank {comm.index} failed in {op} ({type(err).__name__}: {err}), and domain ranks {differ} had run "
        "different domain ops before it: the ranks took different paths. Latest here:\n" + divergence.recent_ops()
        + "\n" + divergence.LIKELY_CAUSE)


def _replies_landed(others: list[int], works: list, landed: int) -> list[int]:
    """The peers whose reply was seen to land, the first ``landed`` of ``works`` having completed: gloo posts one work
    per message, the sends to ``others`` first, then their replies in that order (peer ``others[i]``'s reply is work
    ``len(others) + i``); NCCL posts one work for every message."""
    if len(works) == 1:
        return list(others) if landed else []
    return [q for i, q in enumerate(others) if len(others) + i < landed]


def _journal_of(reply: torch.Tensor) -> int | None:
    """The fingerprint a peer's reply or failure notice carries; None for anything else (a stop notice, from a peer
    that heard of us on a grid line or of another rank's stop, carries none)."""
    magic, kind, fingerprint = divergence.fields(reply)[:3]
    return fingerprint if magic == divergence.MAGIC and kind in (divergence.KIND_DATA, divergence.KIND_ERROR) else None

