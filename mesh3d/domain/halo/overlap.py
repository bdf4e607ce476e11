"""Window ops with their halo messages in flight while the interior rows are computed.

Usage (a rule opts in; the dispatcher does the rest)::

    Step(compute, (Window(input, plan, overlap=(extent, stride)),), out=...)
    with domain.window_overlap(False):   # the plain path (exchange, then one kernel call), e.g. to compare
        y = model(xs)

For a window op of extent ``e = d*(k-1)+1`` and stride ``s``, output row ``o`` of this rank reads
rows ``o*s .. o*s+e-1`` of its extended input (kernel padding, rows from the left peers, its own
rows, rows from the right peers, kernel padding). The outputs whose rows are all its own form
the *interior*. Forward: the halo messages are posted, the interior is computed from the shard
alone while they travel, then the two boundary strips (a few rows each) from the received rows,
and the three results are concatenated. Nothing input-sized is copied: the interior reads the
shard itself. Backward runs in the mirrored order: the strips' gradients are computed first and
their halo rows posted back to their owners (``_Finish.backward``), the interior's gradient is
computed while they travel, and the received gradients are added last (``_Begin.backward``).
NOTE: this order comes from autograd's ready queue, which runs the most recently created node
first: ``_Finish`` is created after the interior compute, ``_Begin`` before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from mesh3d.domain.core.linear import linear_map
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import (PendingExchange, check_local_rows, exchange_point, new_buffers, rows_of,
                                         start_exchange)
from mesh3d.domain.comm.rows import ExchangePlan, Piece
from mesh3d.domain.halo.windows import Extended
from mesh3d.domain.core.plan_cache import plan_cache
from mesh3d.domain.core.settings import SETTINGS, OverlapSettings

__all__ = ["OVERLAP_STATS", "HaloInFlight", "OverlapStats", "WindowSplit", "run_overlapped", "split_window", "window_overlap"]


class OverlapStats:
    """How many window ops ran overlapped so far in this process (``calls``): a counter, not a setting."""

    def __init__(self) -> None:
        self.calls = 0


OVERLAP_STATS = OverlapStats()


@contextlib.contextmanager
def window_overlap(enabled: bool, *, blocks: bool | None = None) -> Iterator[None]:
    """Turn halo/compute overlap of window ops on or off inside the block (results are the same either way);
    ``blocks`` (default: ``enabled``) sets it on block layouts, where it is off outside such a block.

    Usage: ``with domain.window_overlap(False): y = model(xs)``; ``with domain.window_overlap(True): y = net(bs)``
    """
    overlap = OverlapSettings(enabled, enabled if blocks is None else blocks)
    with SETTINGS.replaced(replace(SETTINGS.value, overlap=overlap)):
        yield


@dataclass(frozen=True)
class WindowSplit:
    """Where this rank's extended input splits into a left strip, the interior and a right strip.

    ``lead``/``trail``: the pieces (fill, received) before and after the own rows; ``pad``: the kernel's
    padding rows on each side; ``interior``: (first local row, rows) the interior outputs read;
    ``left_rows``/``right_rows``: the rows each strip reads; ``left_own``: own rows at the end of the
    left strip; ``right_own_start``: the first own row of the right strip (it runs to the end of the rows).
    """

    lead: tuple[Piece, ...]
    own: Piece
    trail: tuple[Piece, ...]
    pad: int
    interior: tuple[int, int]
    left_rows: int
    left_own: int
    right_rows: int
    right_own_start: int


@plan_cache(maxsize=1024)
def split_window(plan: ExchangePlan, pad: int, extent: int, stride: int, out_rows: int) -> WindowSplit | None:
    """The split of a window op's rows (module docstring), or None when no output reads only own rows.

    Usage: ``split_window(xplan, pad, extent=3, stride=1, out_rows=mine)``
    """
    kinds = [p.kind for p in plan.pieces]
    if out_rows <= 0 or kinds.count("own") != 1:
        return None
    at = kinds.index("own")
    own, lead, trail = plan.pieces[at], plan.pieces[:at], plan.pieces[at + 1:]
    before = pad + sum(p.count for p in lead)  # extended rows before the own rows (kernel padding included)
    first = -(-before // stride)  # first output reading no row before the own rows
    last = (before + own.count - extent) // stride  # last output reading no row after them
    if last < first:
        return None
    total = (out_rows - 1) * stride + extent  # extended rows read by this rank's outputs
    left_rows = (first - 1) * stride + extent if first > 0 else 0
    right_from = (last + 1) * stride if last + 1 < out_rows else total
    right_rows = total - right_from
    # NOTE: the strips must read every received row (a stride longer than the window skips some; their
    # gradient would then be missing from the message back to the owner): keep the plain path there.
    if total != 2 * pad + plan.length or left_rows < before or right_from > before + own.count:
        return None
    return WindowSplit(
        lead, own, trail, pad,
        interior=(own.start + first * stride - before, (last - first) * stride + extent),
        left_rows=left_rows,
        left_own=min(max(left_rows - before, 0), own.count),
        right_rows=right_rows,
        right_own_start=own.start + right_from - before,
    )


class _Exchange:
    """One overlapped exchange's state, shared by its two autograd nodes."""

    def __init__(self, dim: int, plan: ExchangePlan, split: WindowSplit, comm: DomainComm, fill: float) -> None:
        self.dim, self.plan, self.split, self.comm, self.fill = dim, plan, split, comm, fill
        self.forward: PendingExchange | None = None
        self.received: dict[int, torch.Tensor] = {}
        self.backward: PendingExchange | None = None
        self.grad_received: list[tuple[int, torch.Tensor]] = []
        self.own_grads: list[tuple[int, torch.Tensor]] = []  # (local row, gradient rows) from the strips
        self.recorded = False  # the strips' gradient went through autograd (create_graph=True)

    def fresh(self) -> _Exchange:
        """A new exchange of the same rows (for a recorded gradient's own gradient)."""
        return _Exchange(self.dim, self.plan, self.split, self.comm, self.fill)


class _Begin(torch.autograd.Function):
    """Forward: post the halo messages. Backward (runs last): add the strips' and the peers' gradients."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, state: _Exchange) -> torch.Tensor:
        ctx.state = state
        _post(local, state)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        state, dim = ctx.state, ctx.state.dim
        if state.recorded:  # create_graph=True: the strips' gradient came through autograd (``_Finish.backward``)
            state.recorded = False
            return grad, None
        # NOTE: ``grad`` is the interior kernel's fresh input gradient (this node's output has no other
        # consumer), so the strips' and peers' rows are added to it in place: no input-sized copy.
        grad = grad if grad.is_contiguous() else grad.contiguous()
        for row, g in state.own_grads:
            grad.narrow(dim, row, g.shape[dim]).add_(g)
        if state.backward is not None:
            state.backward.wait()
        for (peer, runs), (_, buf) in zip(state.plan.send, state.grad_received):
            at = 0
            for start, count in runs:
                grad.narrow(dim, start, count).add_(buf.narrow(dim, at, count))
                at += count
        state.own_grads, state.grad_received, state.backward = [], [], None
        return grad, None


class _Finish(torch.autograd.Function):
    """Forward: wait for the halo rows and build the two strips. Backward (runs first): post their halo gradients."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, state: _Exchange) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.state, ctx.local_shape = state, local.shape
        return _strips(local, state)

    @staticmethod
    def backward(ctx, grad_left: torch.Tensor, grad_right: torch.Tensor):
        state, shape = ctx.state, ctx.local_shape
        if torch.is_grad_enabled():
            # NOTE: create_graph=True (second derivatives): the strips' gradient, own rows and the peers' alike, is
            # computed now (the exchange back not overlapped) and recorded; its own gradient is the strips again.
            state.recorded = True
            return linear_map(lambda gl, gr: _strips_adjoint(gl, gr, state, shape),
                              lambda t: _strips(t, _post(t, state.fresh())), grad_left, grad_right), None
        split, dim = state.split, state.dim
        back: dict[int, list[torch.Tensor]] = {}
        # Left strip: [kernel padding][lead pieces][left_own own rows], its first left_rows rows.
        at = _route(grad_left, dim, split.pad, split.lead, back)
        if split.left_own:
            state.own_grads.append((split.own.start, grad_left.narrow(dim, at, split.left_own)))
        # Right strip: [own rows from right_own_start][trail pieces][kernel padding].
        own_right = split.own.start + split.own.count - split.right_own_start
        if split.right_rows and own_right:
            state.own_grads.append((split.right_own_start, grad_right.narrow(dim, 0, own_right)))
        _route(grad_right, dim, own_right, split.trail, back)
        outgoing = [(peer, parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim))
                    for peer, parts in back.items()]
        incoming = new_buffers(grad_left if grad_left.numel() else grad_right, dim,
                               [(peer, sum(c for _, c in runs)) for peer, runs in state.plan.send])
        state.backward = start_exchange(state.comm, outgoing, incoming, exchange_point(state.comm))
        state.grad_received = incoming
        return None, None


def _post(local: torch.Tensor, state: _Exchange) -> _Exchange:
    """Post ``local``'s halo rows to the peers and the buffers for theirs (``state.forward`` waits for them)."""
    outgoing = [(peer, rows_of(local, state.dim, runs)) for peer, runs in state.plan.send]
    incoming = new_buffers(local, state.dim, list(state.plan.recv))
    state.forward = start_exchange(state.comm, outgoing, incoming, exchange_point(state.comm))
    state.received = dict(incoming)
    return state


def _strips(local: torch.Tensor, state: _Exchange) -> tuple[torch.Tensor, torch.Tensor]:
    """Wait for the halo rows and build the two strips of ``state.split``."""
    assert state.forward is not None
    state.forward.wait()
    split, dim = state.split, state.dim
    head = _fill(local, dim, split.pad, state.fill)
    left = _join_strip(local, dim, (head, *_parts(local, dim, split.lead, state)),
                       local.narrow(dim, split.own.start, split.left_own), split.left_rows, before=True)
    tail = (*_parts(local, dim, split.trail, state), _fill(local, dim, split.pad, state.fill))
    right = _join_strip(local, dim, tail, local.narrow(dim, split.right_own_start,
                        split.own.start + split.own.count - split.right_own_start), split.right_rows, before=False)
    return left, right


def _strips_adjoint(grad_left: torch.Tensor, grad_right: torch.Tensor, state: _Exchange,
                    shape: torch.Size) -> torch.Tensor:
    """The strips' gradient as the shard's: own rows added in place, received rows sent home (and theirs added)."""
    split, dim = state.split, state.dim
    grad = grad_left.new_zeros(shape)
    back: dict[int, list[torch.Tensor]] = {}
    at = _route(grad_left, dim, split.pad, split.lead, back)
    if split.left_own:
        grad.narrow(dim, split.own.start, split.left_own).add_(grad_left.narrow(dim, at, split.left_own))
    own_right = split.own.start + split.own.count - split.right_own_start
    if split.right_rows and own_right:
        grad.narrow(dim, split.right_own_start, own_right).add_(grad_right.narrow(dim, 0, own_right))
    _route(grad_right, dim, own_right, split.trail, back)
    outgoing = [(peer, parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)) for peer, parts in back.items()]
    incoming = new_buffers(grad, dim, [(peer, sum(c for _, c in runs)) for peer, runs in state.plan.send])
    start_exchange(state.comm, outgoing, incoming, exchange_point(state.comm)).wait()
    for (_, runs), (_, buf) in zip(state.plan.send, incoming):
        at = 0
        for start, count in runs:
            grad.narrow(dim, start, count).add_(buf.narrow(dim, at, count))
            at += count
    return grad


def _fill(like: torch.Tensor, dim: int, rows: int, value: float) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = rows
    return like.new_full(shape, value)


def _parts(local: torch.Tensor, dim: int, pieces: tuple[Piece, ...], state: _Exchange) -> list[torch.Tensor]:
    return [_fill(local, dim, p.count, state.fill) if p.kind == "fill"
            else state.received[p.peer].narrow(dim, p.start, p.count) for p in pieces]


def _join_strip(local: torch.Tensor, dim: int, others: tuple[torch.Tensor, ...], own: torch.Tensor, rows: int,
                before: bool) -> torch.Tensor:
    """A strip: the other rows before (left strip) or after (right strip) the own rows (``rows`` in all)."""
    parts = [p for p in ((*others, own) if before else (own, *others)) if p.shape[dim]]
    whole = torch.cat(parts, dim) if parts else own
    if whole.shape[dim] != rows:
        raise AssertionError("a strip's rows do not add up: the overlap split is inconsistent")
    return whole.contiguous()


def _route(grad: torch.Tensor, dim: int, at: int, pieces: tuple[Piece, ...], back: dict[int, list[torch.Tensor]]) -> int:
    """Send the gradient rows of received pieces (starting at strip row ``at``) back to their owners."""
    for p in pieces:
        if p.kind == "recv":
            back.setdefault(p.peer, []).append(grad.narrow(dim, at, p.count))
        at += p.count
    return at


class HaloInFlight:
    """One overlapped exchange as two calls: ``begin`` posts the halo messages (compute what needs no
    received row next), ``finish`` waits and returns the two strips of ``split``. Autograd runs them
    mirrored (module docstring): call ``finish`` after the interior compute, so that its backward runs first.

    Usage: ``halo = HaloInFlight(dim, plan, split, comm, 0.0); shard = halo.begin(local); ...;
    left, right = halo.finish(shard)``
    """

    def __init__(self, dim: int, plan: ExchangePlan, split: WindowSplit, comm: DomainComm, fill: float) -> None:
        self._state = _Exchange(dim, plan, split, comm, fill)

    def begin(self, local: torch.Tensor) -> torch.Tensor:
        state = self._state
        check_local_rows(local, state.dim, state.plan, state.comm)
        return _Begin.apply(local, state)

    def finish(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _Finish.apply(shard, self._state)


def run_overlapped(compute: Callable[[Extended], Any], local: torch.Tensor, dim: int, plan: ExchangePlan,
                   split: WindowSplit, comm: DomainComm, fill: float) -> torch.Tensor:
    """``compute`` on this rank's rows with the halo exchange overlapped (module docstring); the local output.

    Usage: ``out = run_overlapped(lambda ext: conv(ext.tensor), local, 2, xplan, split, comm, 0.0)``
    """
    halo = HaloInFlight(dim, plan, split, comm, fill)
    shard = halo.begin(local)
    start, rows = split.interior
    interior = compute(Extended(shard if (start, rows) == (0, local.shape[dim]) else shard.narrow(dim, start, rows), 0))
    left, right = halo.finish(shard)
    parts = [compute(Extended(left, 0))] if split.left_rows else []
    parts.append(interior)
    if split.right_rows:
        parts.append(compute(Extended(right, 0)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
