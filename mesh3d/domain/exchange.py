"""Point-to-point row exchange on the domain sub-mesh: the one communication primitive for halos.

Usage::

    plan = plan_exchange(sizes, needs, me)        # needs[r]: the runs of global rows rank r wants
    ext = gather_rows(local, dim, plan, comm)     # differentiable; backward adds gradients to owners

Every halo (conv, pool, pad modes, interpolation), ``full_tensor`` and ``redistribute`` is a row
map per rank (``rows.Span`` runs). Rows a rank owns are sliced from its shard (a view when they
are the whole result: nothing is copied), rows owned by others arrive from their owners, however
many ranks away, one message per (sender, receiver) pair, all posted together in one
``batch_isend_irecv``. Fill rows hold a constant (zero padding, ``-inf`` for max pooling). The
backward is the exact adjoint: gradient rows go back to their owners, which add them; a rank that
sends nothing gets its gradient as a view, without a zero-filled copy.
Peers are the *global* ranks of the domain group (``comm.ranks``), never global rank ± 1.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mesh3d.domain.rows import ExchangePlan, Piece

__all__ = ["DomainComm", "TrafficCounter", "count_traffic", "gather_rows"]


@dataclass(frozen=True)
class DomainComm:
    """The domain group: its process group, its members' global ranks in axis order, and my index."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)


class TrafficCounter:
    """Bytes this process sent through ``gather_rows`` (forward and backward) while it was active.

    Usage: ``with count_traffic() as traffic: step(); traffic.bytes_sent``
    """

    _active: list[TrafficCounter] = []  # counters open now (nested ones all count)

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.messages = 0
        self.rounds = 0  # batched exchanges (one batch_isend_irecv each) this rank took part in
        self.exchange_seconds = 0.0  # wall time inside exchanges (posting and waiting): what overlap could hide

    @classmethod
    def record(cls, nbytes: int, messages: int, seconds: float) -> None:
        for counter in cls._active:
            counter.bytes_sent += nbytes
            counter.messages += messages
            counter.rounds += 1
            counter.exchange_seconds += seconds


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficCounter]:
    """Count the bytes sent by domain exchanges inside the block.

    Usage: ``with count_traffic() as traffic: loss.backward(); print(traffic.bytes_sent)``
    """
    counter = TrafficCounter()
    TrafficCounter._active.append(counter)
    try:
        yield counter
    finally:
        TrafficCounter._active.remove(counter)


def _exchange(comm: DomainComm, outgoing: list[tuple[int, torch.Tensor]],
              incoming: list[tuple[int, torch.Tensor]]) -> None:
    """Send and receive all buffers at once (one batched round of point-to-point messages)."""
    start = time.perf_counter()
    sends = [buf for _, buf in outgoing if buf.numel()]
    ops = [dist.P2POp(dist.isend, buf, comm.ranks[peer], comm.group) for peer, buf in outgoing if buf.numel()]
    ops += [dist.P2POp(dist.irecv, buf, comm.ranks[peer], comm.group) for peer, buf in incoming if buf.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if TrafficCounter._active and ops:
        TrafficCounter.record(sum(b.numel() * b.element_size() for b in sends), len(sends),
                              time.perf_counter() - start)


def _rows_of(t: torch.Tensor, dim: int, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The given (start, count) runs of ``t`` along ``dim``, as one contiguous message."""
    if len(runs) == 1:
        return t.narrow(dim, runs[0][0], runs[0][1]).contiguous()
    return torch.cat([t.narrow(dim, s, c) for s, c in runs], dim)


def _buffers(like: torch.Tensor, dim: int, counts: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
    shape = list(like.shape)
    out = []
    for peer, n in counts:
        shape[dim] = n
        out.append((peer, like.new_empty(shape)))
    return out


def _assemble(local: torch.Tensor, dim: int, pieces: tuple[Piece, ...], received: dict[int, torch.Tensor],
              fill: float) -> torch.Tensor:
    parts = []
    for p in pieces:
        if p.kind == "own":
            parts.append(local.narrow(dim, p.start, p.count))
        elif p.kind == "recv":
            parts.append(received[p.peer].narrow(dim, p.start, p.count))
        else:
            shape = list(local.shape)
            shape[dim] = p.count
            parts.append(local.new_full(shape, fill))
    if all(p.kind == "fill" for p in pieces):
        # Keep the result connected to the shard, so its gradient (zeros) exists on every rank.
        parts.insert(0, local.narrow(dim, 0, 0))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, plan: ExchangePlan, comm: DomainComm, fill: float):
        ctx.dim, ctx.plan, ctx.comm, ctx.local_shape = dim, plan, comm, local.shape
        outgoing = [(peer, _rows_of(local, dim, runs)) for peer, runs in plan.send]
        incoming = _buffers(local, dim, list(plan.recv))
        _exchange(comm, outgoing, incoming)
        return _assemble(local, dim, plan.pieces, dict(incoming), fill)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim, plan = ctx.dim, ctx.plan
        own: list[tuple[Piece, torch.Tensor]] = []
        back: dict[int, list[torch.Tensor]] = {}
        at = 0
        for p in plan.pieces:
            if p.kind == "own":
                own.append((p, grad.narrow(dim, at, p.count)))
            elif p.kind == "recv":
                back.setdefault(p.peer, []).append(grad.narrow(dim, at, p.count))
            at += p.count
        # Reverse every message: what I received goes back as gradient; what I sent comes back.
        outgoing = [(peer, parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim))
                    for peer, parts in back.items()]
        incoming = _buffers(grad, dim, [(peer, sum(c for _, c in runs)) for peer, runs in plan.send])
        _exchange(ctx.comm, outgoing, incoming)
        whole = len(own) == 1 and own[0][0].start == 0 and own[0][0].count == ctx.local_shape[dim]
        if whole and not incoming:
            return own[0][1], None, None, None, None
        grad_local = own[0][1].clone() if whole else grad.new_zeros(ctx.local_shape)
        if not whole:
            for p, g in own:
                grad_local.narrow(dim, p.start, p.count).add_(g)
        for (peer, runs), (_, buf) in zip(plan.send, incoming):
            at = 0
            for start, count in runs:
                grad_local.narrow(dim, start, count).add_(buf.narrow(dim, at, count))
                at += count
        return grad_local, None, None, None, None


def gather_rows(local: torch.Tensor, dim: int, plan: ExchangePlan, comm: DomainComm, fill: float = 0.0) -> torch.Tensor:
    """This rank's needed rows along ``dim`` (per ``plan``), fetched from their owners; differentiable.

    Usage: ``ext = gather_rows(local, 2, plan_exchange(sizes, needs, me), comm)``

    When nothing moves to or from this rank the result is built by slicing (the whole shard
    itself when that is what the plan asks for), so autograd sees only torch's own views.
    """
    if plan.moves_nothing:
        if plan.is_local_view:
            return local
        return _assemble(local, dim, plan.pieces, {}, fill)
    return _GatherRows.apply(local, dim, plan, comm, fill)
