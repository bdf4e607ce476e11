"""Point-to-point row exchange on the domain sub-mesh: the one communication primitive for halos.

Usage::

    plan = build_plan(sizes, needs, me)           # needs[r]: global row indices rank r wants (-1 = fill)
    ext = gather_rows(local, dim, plan, comm)     # differentiable; backward adds gradients to owners

Every halo (conv, pool, pad modes, interpolation) is a list of global row indices each rank
needs along the sharded dim. Rows a rank owns are copied locally; rows owned by others arrive
from their owners, however many ranks away (so shards smaller than the halo work), one message
per (sender, receiver) pair, all posted together in one ``batch_isend_irecv``. Index ``-1``
marks a position filled with a constant (zero padding, ``-inf`` for max pooling).
The backward is the exact adjoint: gradient rows go back to their owners, which add them.
Peers are the *global* ranks of the domain group (``comm.ranks``), never global rank ± 1.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from mesh3d.domain.split import offsets_of

__all__ = ["TRAFFIC", "DomainComm", "ExchangePlan", "build_plan", "gather_rows"]

#: Bytes this process has sent through ``gather_rows`` (forward and backward); benchmarks read it.
TRAFFIC = {"bytes_sent": 0}


@dataclass(frozen=True)
class DomainComm:
    """The domain group: its process group, its members' global ranks in axis order, and my index."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ExchangePlan:
    """What this rank copies, sends and receives for one gather (positions are in the result)."""

    length: int  # rows in this rank's result
    own_pos: tuple[int, ...]
    own_idx: tuple[int, ...]
    send: tuple[tuple[int, tuple[int, ...]], ...]  # (peer index, local rows to send)
    recv: tuple[tuple[int, tuple[int, ...]], ...]  # (peer index, result positions to fill)

    @property
    def own_run(self) -> tuple[int, int, int] | None:
        """(result start, local start, count) when the own rows are one contiguous run (the usual halo case)."""
        n = len(self.own_pos)
        if n and self.own_pos[-1] - self.own_pos[0] == n - 1 and self.own_idx[-1] - self.own_idx[0] == n - 1 \
                and all(b - a == 1 for a, b in zip(self.own_idx, self.own_idx[1:])):
            return self.own_pos[0], self.own_idx[0], n
        return None

    @property
    def bytes_rows(self) -> int:
        """Rows this rank receives from others (halo rows; for communication accounting)."""
        return sum(len(p) for _, p in self.recv)


@lru_cache(maxsize=512)
def build_plan(sizes: tuple[int, ...], needs: tuple[tuple[int, ...], ...], me: int) -> ExchangePlan:
    """The exchange plan of rank ``me`` given every rank's needed global rows (``-1`` = fill)."""
    offsets = offsets_of(sizes)
    total = sum(sizes)
    # Owners: the rank whose [offset, offset+size) holds g (empty shards own nothing).
    starts = [o for o, s in zip(offsets, sizes) if s > 0]
    owner_of_start = [r for r, s in enumerate(sizes) if s > 0]

    def owner(g: int) -> int:
        if not 0 <= g < total:
            raise IndexError(f"row {g} is outside the global length {total}")
        return owner_of_start[bisect.bisect_right(starts, g) - 1]

    own_pos: list[int] = []
    own_idx: list[int] = []
    recv: dict[int, list[int]] = {}
    for pos, g in enumerate(needs[me]):
        if g < 0:
            continue
        q = owner(g)
        if q == me:
            own_pos.append(pos)
            own_idx.append(g - offsets[me])
        else:
            recv.setdefault(q, []).append(pos)
    send: dict[int, list[int]] = {}
    for r, wanted in enumerate(needs):
        if r == me:
            continue
        for g in wanted:
            if g >= 0 and owner(g) == me:
                send.setdefault(r, []).append(g - offsets[me])
    return ExchangePlan(
        length=len(needs[me]),
        own_pos=tuple(own_pos),
        own_idx=tuple(own_idx),
        send=tuple((q, tuple(v)) for q, v in sorted(send.items())),
        recv=tuple((q, tuple(v)) for q, v in sorted(recv.items())),
    )


def _index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _exchange(
    comm: DomainComm,
    outgoing: list[tuple[int, torch.Tensor]],
    incoming: list[tuple[int, torch.Tensor]],
) -> None:
    """Send and receive all buffers at once (one batched round of point-to-point messages)."""
    ops = [dist.P2POp(dist.isend, buf, comm.ranks[q], comm.group) for q, buf in outgoing if buf.numel()]
    TRAFFIC["bytes_sent"] += sum(buf.numel() * buf.element_size() for _, buf in outgoing)
    ops += [dist.P2POp(dist.irecv, buf, comm.ranks[q], comm.group) for q, buf in incoming if buf.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, plan: ExchangePlan, comm: DomainComm, fill: float):
        ctx.dim, ctx.plan, ctx.comm, ctx.local_shape = dim, plan, comm, local.shape
        shape = list(local.shape)
        shape[dim] = plan.length
        out = local.new_full(shape, fill)
        device = local.device
        outgoing = [(q, local.index_select(dim, _index(idx, device)).contiguous()) for q, idx in plan.send]
        incoming = []
        for q, pos in plan.recv:
            shape[dim] = len(pos)
            incoming.append((q, local.new_empty(shape)))
        _exchange(comm, outgoing, incoming)
        run = plan.own_run
        if run is not None:  # a plain slice copy: no index tensors
            out.narrow(dim, run[0], run[2]).copy_(local.narrow(dim, run[1], run[2]))
        elif plan.own_pos:
            out.index_copy_(dim, _index(plan.own_pos, device), local.index_select(dim, _index(plan.own_idx, device)))
        for (q, pos), (_, buf) in zip(plan.recv, incoming):
            out.index_copy_(dim, _index(pos, device), buf)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim, plan, comm = ctx.dim, ctx.plan, ctx.comm
        device = grad.device
        grad_local = grad.new_zeros(ctx.local_shape)
        # Reverse every message: what I received, I send back as gradient; what I sent comes back.
        outgoing = [(q, grad.index_select(dim, _index(pos, device)).contiguous()) for q, pos in plan.recv]
        incoming = []
        shape = list(ctx.local_shape)
        for q, idx in plan.send:
            shape[dim] = len(idx)
            incoming.append((q, grad.new_empty(shape)))
        _exchange(comm, outgoing, incoming)
        run = plan.own_run
        if run is not None:
            grad_local.narrow(dim, run[1], run[2]).add_(grad.narrow(dim, run[0], run[2]))
        elif plan.own_pos:
            grad_local.index_add_(dim, _index(plan.own_idx, device), grad.index_select(dim, _index(plan.own_pos, device)))
        for (q, idx), (_, buf) in zip(plan.send, incoming):
            grad_local.index_add_(dim, _index(idx, device), buf)
        return grad_local, None, None, None, None


def gather_rows(local: torch.Tensor, dim: int, plan: ExchangePlan, comm: DomainComm, fill: float = 0.0) -> torch.Tensor:
    """This rank's needed rows along ``dim`` (per ``plan``), fetched from their owners; differentiable."""
    return _GatherRows.apply(local, dim, plan, comm, fill)
