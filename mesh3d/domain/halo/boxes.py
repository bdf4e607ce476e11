"""Rows of blocks in one round: every neighbour's box (faces, edges, corners) posted at once.

Usage::

    plans = [halo_rows_only(sizes, plan_window(sizes, 3, 1, 1, 1, 1), line.index)[0] for ...]  # one per grid dim
    ext = gather_box(local, dims, plans, coords, grid, comm)   # differentiable; backward adds gradients to owners

A window's footprint of a box is a box: along each grid dim ``k`` this rank needs the rows of its
1-D plan ``plans[k]`` (from the ranks ``q_k`` of its grid line), whatever the other dims hold. So
the extended block is the product of the per-dim plans: the cell of pieces ``(p_0, p_1, ...)``
comes from the domain rank at grid coordinates ``(q_0, q_1, ...)`` (``q_k`` being this rank's own
coordinate where ``p_k`` is an own piece), and that rank sends the product of the runs each dim's
plan assigns it. One message per peer, corners included, all posted in one ``batch_isend_irecv``
on the domain group after one header round: two rounds per window op, against two per grid dim
when the grid dims go one after the other (``scripts/bench_halo_rounds.py`` measures both).
The bytes are the same: each element a rank reads from another crosses once, straight to it.
The backward is the exact adjoint: gradient boxes go back to their owners, which add them.
Any row maps whose product is what a rank needs work alike (a fill row along any dim makes its
cell fill): transposed convolutions and ``F.pad`` use it too (``blocks.box_plans``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mesh3d.domain.core.linear import linear_op
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import exchange_point, rows_of, swap
from mesh3d.domain.comm.compiled_exchange import received_shape
from mesh3d.domain.comm.rows import ExchangePlan
from mesh3d.domain.core.plan_cache import plan_cache

__all__ = ["FILL", "OWN", "BoxPlan", "gather_box", "plan_box"]

OWN, FILL = -1, -2  # a cell's source when it is not a peer's message: this rank's shard, or the fill value
Runs = tuple[tuple[int, int], ...]  # (start, count) runs along one dim
Cell = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]  # per dim: (result start, count), (source start, count)


@dataclass(frozen=True)
class BoxPlan:
    """One rank's one-round exchange over the domain group (peers are domain ranks, row-major grid order)."""

    shape: tuple[int, ...]  # the extended block's length along each grid dim
    send: tuple[tuple[int, tuple[Runs, ...]], ...]  # (peer, per dim the local runs it gets), in peer order
    recv: tuple[tuple[int, tuple[int, ...]], ...]  # (peer, its message's length along each grid dim), in peer order
    cells: tuple[tuple[int, Cell], ...]  # (peer, OWN or FILL, (result box, box in the message or shard))


def _per_dim(plan: ExchangePlan, me: int) -> tuple[dict[int, Runs], dict[int, int], list[tuple[int, ...]]]:
    """Along one grid dim: runs sent to each line rank (own rows to this rank's own coordinate), message
    lengths by line rank, and the result's pieces as (line rank or FILL, result start, count, local start, message
    start)."""
    send = dict(plan.send)
    recv = dict(plan.recv)
    own: list[tuple[int, int]] = []
    pieces = []
    at = own_at = 0
    for p in plan.pieces:
        if p.kind == "fill":
            pieces.append((FILL, at, p.count, -1, -1))
        elif p.kind == "own":
            own.append((p.start, p.count))
            pieces.append((me, at, p.count, p.start, own_at))
            own_at += p.count
        else:
            pieces.append((p.peer, at, p.count, -1, p.start))
        at += p.count
    if own:  # a peer with this coordinate needs from this rank what this rank needs from itself along this dim
        send[me], recv[me] = tuple(own), own_at
    return send, recv, pieces


@plan_cache(maxsize=1024)
def plan_box(plans: tuple[ExchangePlan, ...], coords: tuple[int, ...], grid: tuple[int, ...]) -> BoxPlan:
    """The product of one 1-D halo plan per grid dim (``coords``: this rank's grid coordinates).

    Usage: ``plan = plan_box(tuple(plans), (i, j), (2, 2))``
    """
    per_dim = [_per_dim(plan, c) for plan, c in zip(plans, coords)]
    strides = [math.prod(grid[k + 1:]) for k in range(len(grid))]

    def rank_of(q: Sequence[int]) -> int:
        return sum(a * s for a, s in zip(q, strides))

    me = rank_of(coords)
    send = [(rank_of(q), tuple(per_dim[k][0][a] for k, a in enumerate(q)))
            for q in itertools.product(*(sorted(d[0]) for d in per_dim))]
    recv = [(rank_of(q), tuple(per_dim[k][1][a] for k, a in enumerate(q)))
            for q in itertools.product(*(sorted(d[1]) for d in per_dim))]
    cells = []
    for combo in itertools.product(*(d[2] for d in per_dim)):
        result = tuple((c[1], c[2]) for c in combo)
        if any(c[0] == FILL for c in combo):  # a fill row along any dim: the whole cell is fill
            cells.append((FILL, (result, result)))
            continue
        peer = rank_of([c[0] for c in combo])
        source = tuple((c[3] if peer == me else c[4], c[2]) for c in combo)  # the shard, or the peer's message
        cells.append((OWN if peer == me else peer, (result, source)))
    return BoxPlan(shape=tuple(p.length for p in plans),
                   send=tuple((p, r) for p, r in send if p != me),
                   recv=tuple((p, n) for p, n in recv if p != me),
                   cells=tuple(cells))


def _box(t: torch.Tensor, dims: Sequence[int], box: Sequence[tuple[int, int]]) -> torch.Tensor:
    for d, (start, count) in zip(dims, box):
        t = t.narrow(d, start, count)
    return t


def _pack(local: torch.Tensor, dims: Sequence[int], runs: tuple[Runs, ...]) -> torch.Tensor:
    """The product of ``runs`` (per dim) of ``local``, contiguous: one message."""
    for d, dim_runs in sorted(zip(dims, runs), key=lambda dr: len(dr[1]) > 1):  # views first: copy only the box
        local = local.narrow(d, *dim_runs[0]) if len(dim_runs) == 1 else rows_of(local, d, dim_runs)
    return local.contiguous()


def _runs_boxes(runs: tuple[Runs, ...]):
    """(local box, message box) for every product of runs: where a packed message's parts came from."""
    per_dim = []
    for dim_runs in runs:
        at, parts = 0, []
        for start, count in dim_runs:
            parts.append(((start, count), (at, count)))
            at += count
        per_dim.append(parts)
    for combo in itertools.product(*per_dim):
        yield tuple(c[0] for c in combo), tuple(c[1] for c in combo)


def _gather_box(local: torch.Tensor, dims: tuple[int, ...], plan: BoxPlan, comm: DomainComm, fill: float,
                fingerprint) -> torch.Tensor:
    """The box of ``plan`` (not differentiable by itself: ``gather_box`` is)."""
    outgoing = [(peer, _pack(local, dims, runs)) for peer, runs in plan.send]
    received = swap(comm, outgoing, local, dims, list(plan.recv), fingerprint)
    out = local.new_empty(received_shape(local, dims, plan.shape))
    for peer, (result, source) in plan.cells:
        if peer == FILL:
            _box(out, dims, result).fill_(fill)
        else:
            _box(out, dims, result).copy_(_box(local if peer == OWN else received[peer], dims, source))
    return out


def _scatter_box(grad: torch.Tensor, dims: tuple[int, ...], plan: BoxPlan, comm: DomainComm,
                 local_shape: torch.Size) -> torch.Tensor:
    """The adjoint of ``_gather_box``: gradient boxes go back to their owners, which add them."""
    back = {peer: grad.new_empty(received_shape(grad, dims, lengths)) for peer, lengths in plan.recv}
    grad_local = grad.new_zeros(local_shape)
    for peer, (result, source) in plan.cells:  # every message is covered by its peer's cells exactly once
        if peer != FILL:
            target = _box(grad_local, dims, source).add_ if peer == OWN else _box(back[peer], dims, source).copy_
            target(_box(grad, dims, result))
    counts = [(peer, tuple([sum([n for _, n in r]) for r in runs])) for peer, runs in plan.send]
    received = swap(comm, list(back.items()), grad, dims, counts, exchange_point(comm))
    incoming = [(peer, received[peer]) for peer, _ in counts]
    for (_, runs), (_, buf) in zip(plan.send, incoming):
        for local_box, message_box in _runs_boxes(runs):
            _box(grad_local, dims, local_box).add_(_box(buf, dims, message_box))
    return grad_local


def gather_box(local: torch.Tensor, dims: tuple[int, ...], plans: tuple[ExchangePlan, ...], coords: tuple[int, ...],
               grid: tuple[int, ...], comm: DomainComm, fill: float = 0.0) -> torch.Tensor:
    """This rank's rows of ``plans`` (one 1-D plan per grid dim ``dims``; fill rows hold ``fill``), in one round.

    Usage: ``ext = gather_box(local, (2, 3), (plan_h, plan_w), (i, j), (2, 2), spec.comm)``
    """
    plan = plan_box(plans, coords, grid)
    if not plan.send and not plan.recv and len(plan.cells) == 1 and plan.cells[0][0] == OWN:
        return _box(local, dims, plan.cells[0][1][1])  # nothing moves: a view of the shard
    point, shape = exchange_point(comm), local.shape
    # NOTE: recorded with create_graph=True (second derivatives): the adjoint's own gradient is the gather, fill 0
    return linear_op(lambda t: _gather_box(t, dims, plan, comm, fill, point),
                     lambda g: _scatter_box(g, dims, plan, comm, shape), local,
                     again=lambda g: _gather_box(g, dims, plan, comm, 0.0, exchange_point(comm)))
