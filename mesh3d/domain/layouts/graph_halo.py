"""Every exchange and collective of the graph layout, in one module: halo rows in and sums back, the whole tensor, a
mask's global form, and the reductions.

Usage::

    ext = gather_halo(local, dim, plan, comm)      # [own rows; the halo rows] (plan: mesh3d.graphs.HaloPlan)
    own = scatter_halo(ext, dim, plan, comm)       # the adjoint: halo rows' contributions sent home and added
    whole = gather_all(local, dim, items, comm)    # every item in global order (full_tensor)
    keep = global_mask(mask_local, items, comm)    # a bool mask of every item (numpy), one bit per item sent
    parts = gather_varying(values, comm)           # every rank's 1-D values (lengths differ), in rank order
    total = reduce_sum(partial, comm)              # a replicated sum (backward: the replicated gradient)

The rules of ``mesh3d.domain.ops.graph`` compute on plain local tensors and call only these for anything that
crosses ranks. Halo moves go through ``exchange.swap`` (headers checked, counted by ``domain.count_traffic``,
dry-run aware), each rank's rows packed with one ``index_select`` per peer; both are linear maps whose gradients
are each other, recorded to any order (``core.linear``).
"""

from __future__ import annotations

import math
import zlib

import numpy as np

import torch

from mesh3d.domain.comm.collectives import reduce_to_replicated, sum_grad
from mesh3d.domain.comm.exchange import exchange_all, exchange_point, gather_rows, swap
from mesh3d.domain.comm.rows import Span, plan_exchange
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.settings import refuse_while_traced
from mesh3d.domain.core.linear import linear_op
from mesh3d.graphs import HaloPlan, Partition
from mesh3d.graphs.compiled_tables import table

__all__ = ["entering", "gather_all", "gather_halo", "gather_varying", "global_mask", "reduce_sum", "scatter_halo",
           "shared_mask"]


def _gather(local: torch.Tensor, dim: int, plan: HaloPlan, comm: DomainComm) -> torch.Tensor:
    outgoing = [(peer, local.index_select(dim, table(rows).to(local.device))) for peer, rows in plan.send]
    received = swap(comm, outgoing, local, (dim,), [(q, (n,)) for q, n in plan.recv], exchange_point(comm))
    return torch.cat([local, *(received[q] for q, _ in plan.recv)], dim)


def _scatter(ext: torch.Tensor, dim: int, plan: HaloPlan, comm: DomainComm) -> torch.Tensor:
    outgoing, at = [], plan.own
    for q, n in plan.recv:
        outgoing.append((q, ext.narrow(dim, at, n).contiguous()))
        at += n
    counts = [(peer, (len(rows),)) for peer, rows in plan.send]
    received = swap(comm, outgoing, ext, (dim,), counts, exchange_point(comm))
    own = ext.narrow(dim, 0, plan.own).clone()
    for peer, rows in plan.send:
        own.index_add_(dim, table(rows).to(own.device), received[peer])
    return own


def gather_halo(local: torch.Tensor, dim: int, plan: HaloPlan, comm: DomainComm) -> torch.Tensor:
    """``[local; the halo rows]`` along ``dim``, the halo fetched from its owners; backward sums the halo's gradient
    back into the owners' rows.

    Usage: ``ext = gather_halo(unwrap(x), 0, graph.halo(x.spec.items, comm.index), comm)``
    """
    if plan.moves_nothing:
        return local
    if local.requires_grad and torch.is_grad_enabled():
        # NOTE: recorded with create_graph=True too (its own gradient is the forward move): second derivatives
        return linear_op(lambda t: _gather(t, dim, plan, comm), lambda g: _scatter(g, dim, plan, comm), local)
    return _gather(local, dim, plan, comm)


def scatter_halo(ext: torch.Tensor, dim: int, plan: HaloPlan, comm: DomainComm) -> torch.Tensor:
    """The adjoint of ``gather_halo``: own rows plus every peer's contributions to them (its halo rows of ``ext``).

    Usage: ``own = scatter_halo(partial_sums_on_own_and_halo_rows, 0, plan, comm)``
    """
    if plan.moves_nothing:
        return ext
    if ext.requires_grad and torch.is_grad_enabled():
        return linear_op(lambda t: _scatter(t, dim, plan, comm), lambda g: _gather(g, dim, plan, comm), ext)
    return _scatter(ext, dim, plan, comm)


def _position_in_gather(items: Partition) -> torch.Tensor:
    """Each item's row in the gather of every rank's rows (rank by rank)."""
    starts = torch.tensor(items.offsets, dtype=torch.int64)
    return starts[items.tensor("owner")] + items.tensor("local_index")


def _whole(local: torch.Tensor, dim: int, items: Partition, comm: DomainComm) -> torch.Tensor:
    everything = tuple((Span.rows(0, items.n),) if items.n else () for _ in range(items.parts))
    gathered = gather_rows(local, dim, plan_exchange(items.counts, everything, comm.index), comm)
    return gathered.index_select(dim, _position_in_gather(items).to(local.device))


def gather_all(local: torch.Tensor, dim: int, items: Partition, comm: DomainComm) -> torch.Tensor:
    """Every rank's items in global order along ``dim`` (replicated; backward keeps this rank's items' gradient).

    Usage: ``whole = gather_all(unwrap(x), x.spec.dim, x.spec.items, comm)``
    """
    if comm.size == 1:
        return local
    # a replicated value's gradient is the same everywhere: this rank's items of it
    own = lambda g: g.index_select(dim, items.tensor("items", comm.index).to(g.device))  # noqa: E731
    return linear_op(lambda t: _whole(t, dim, items, comm), own, local)


def global_mask(mask: torch.Tensor, items: Partition, comm: DomainComm) -> np.ndarray:
    """The whole bool mask over ``items`` (every rank's part, one bit per item on the wire), from this rank's part.

    Usage: ``kept = items.take(global_mask(unwrap(m), items, comm))``
    """
    refuse_while_traced("a boolean mask over a graph's items", "the kept items make a new layout")
    mine = mask.detach().cpu().numpy().astype(bool).ravel()
    width = max(1, max(math.ceil(c / 8) for c in items.counts))
    bits = np.zeros(width, dtype=np.uint8)
    packed = np.packbits(mine)
    bits[:len(packed)] = packed
    parts = exchange_all(torch.from_numpy(bits), comm) if comm.size > 1 else [torch.from_numpy(bits)]
    out = np.zeros(items.n, dtype=bool)
    for r, part in enumerate(parts):
        out[items.items(r)] = np.unpackbits(part.numpy())[:items.counts[r]].astype(bool)
    return out


def shared_mask(mask: torch.Tensor, comm: DomainComm) -> np.ndarray | None:
    """A plain bool mask over every item (``dropout_edge``'s draw), as numpy, when every domain rank holds the same
    one; None where they differ (one checksum per rank travels).

    Usage: ``keep = shared_mask(plain_mask, comm)  # None: drawn from streams that differ``
    """
    refuse_while_traced("a plain boolean mask over a graph's items", "the kept items make a new layout")
    keep = mask.detach().cpu().numpy().astype(bool).ravel()
    if comm.size == 1:
        return keep
    mine = torch.tensor([zlib.crc32(np.packbits(keep).tobytes()), keep.size], dtype=torch.int64)
    parts = exchange_all(mine, comm)
    return keep if all(bool(torch.equal(p, parts[0])) for p in parts) else None


def gather_varying(values: torch.Tensor, comm: DomainComm) -> list[torch.Tensor]:
    """Every rank's 1-D ``values`` (of lengths that differ), in rank order, on every rank: each rank's length first
    (one int per rank), then one message of its values to each peer (none where it has none).

    Usage: ``uniques = torch.cat(gather_varying(torch.unique(local), comm))``
    """
    refuse_while_traced("gathering every rank's values", "their lengths are values")
    values = values.detach().contiguous().reshape(-1)
    if comm.size == 1:
        return [values]
    lengths = [int(n) for n in exchange_all(torch.tensor([values.numel()], dtype=torch.int64), comm)]
    others = [q for q in range(comm.size) if q != comm.index]
    row = values.view(1, -1)
    sends = [(q, row) for q in others] if values.numel() else []
    received = swap(comm, sends, row, (1,), [(q, (lengths[q],)) for q in others if lengths[q]], exchange_point(comm))
    return [values if q == comm.index else received[q].view(-1) if lengths[q] else values.new_empty(0)
            for q in range(comm.size)]


def reduce_sum(partial: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """Every rank's ``partial`` summed, replicated; backward hands the replicated gradient to each rank unchanged.

    Usage: ``total = reduce_sum(local.sum(), comm)``
    """
    return reduce_to_replicated(partial, comm)


def entering(value: torch.Tensor, comm: DomainComm) -> torch.Tensor:
    """A replicated value used by every rank's items: its gradient is summed over the domain on the way back.

    Usage: ``scale = entering(unwrap(replicated), comm)``
    """
    return sum_grad(value, comm) if value.requires_grad else value
