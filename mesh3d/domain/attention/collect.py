"""Attention modes that collect what one SDPA call needs, then run torch's own kernel: ``gather`` and ``ulysses``.

Usage (``mesh3d.domain.attention.modes`` picks one; tensors are plain local (B, H, rows, E))::

    out = gather_attention(call, q, k, v, mask)      # every rank gathers all keys/values: O(S) memory
    out = ulysses_attention(call, q, k, v, mask)     # all-to-all: heads/D of every row, then back

``gather`` keeps this rank's queries and gathers every key and value row (one exchange, differentiable: key
and value gradients go home). It is the fastest on short sequences and holds the whole K/V (O(S) per rank).
``ulysses`` (DeepSpeed Ulysses) swaps the sharding from rows to heads with one all-to-all (point-to-point,
uneven rows allowed), runs SDPA on all rows of ``H/D`` heads, and swaps back; it needs the query and K/V
heads to divide by the domain size. Masks (causal, windows, the user's) are read by global index, as in
the ring (``attention_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mesh3d.domain.attention.score_tiles import MaskRule, Tile, Segment, tile_mask
from mesh3d.domain.attention.row_order import RowOrder
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import exchange_point, gather_rows, start_exchange
from mesh3d.domain.comm.rows import Span, plan_exchange
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.connected import connected_zeros

__all__ = ["AttentionCall", "gather_attention", "local_attention", "ulysses_attention"]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call's layout and masking: the query and K/V layouts (every rank's rows, ``RowOrder``),
    the mask rule, the scale, GQA, and how a user mask's rows are read (``"global"``/``"local"``)."""

    comm: DomainComm
    q_order: RowOrder
    kv_order: RowOrder
    rule: MaskRule
    scale: float
    gqa: bool = False
    mask_rows: str | None = None


def _all_rows(layout: RowOrder) -> Segment:
    """Every rank's rows, rank after rank (the order an exchange of all rows delivers them in)."""
    return Segment.joined(r for seg in layout for r in seg.runs)


def _attend(call: AttentionCall, q, k, v, mask, qseg: Segment, kseg: Segment, q_offset: int | None):
    """Torch's SDPA of ``q`` (rows ``qseg``) over ``k``/``v`` (rows ``kseg``), the mask built from the indices."""
    if not qseg.rows or not kseg.rows:
        return connected_zeros(q, (*q.shape[:-1], v.shape[-1]), q, k, v, mask)
    rule = call.rule
    causal = rule.left is None and rule.right == 0 and qseg.runs == ((0, qseg.rows),) and \
        kseg.runs == ((0, kseg.rows),) and mask is None
    piece = Tile(0, qseg.rows, 0, kseg.rows, banded=rule.banded and not causal)
    m = tile_mask(piece, qseg, kseg, rule, mask, q_offset, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=call.scale,
                                          enable_gqa=call.gqa)


def local_attention(call: AttentionCall, q, k, v, mask) -> torch.Tensor:
    """A one-rank domain: torch's SDPA on the local tensors (their rows are the whole sequence, in order).

    Usage: ``out = local_attention(call, q, k, v, None)``
    """
    local = 0 if call.mask_rows == "local" else None
    return _attend(call, q, k, v, mask, _all_rows(call.q_order), _all_rows(call.kv_order), local)


def gather_attention(call: AttentionCall, q, k, v, mask) -> torch.Tensor:
    """This rank's queries against every key/value row, gathered (see the module docstring).

    Usage: ``out = gather_attention(call, q, k, v, None)``
    """
    comm = call.comm
    sizes = tuple(seg.rows for seg in call.kv_order)
    everything = ((Span.rows(0, sum(sizes)),),) * comm.size
    plan = plan_exchange(sizes, everything, comm.index)
    if k.shape[:-1] == v.shape[:-1]:  # keys and values travel as one message
        both = gather_rows(torch.cat([k, v], -1), 2, plan, comm)
        k_all, v_all = both[..., :k.shape[-1]], both[..., k.shape[-1]:]
    else:
        k_all, v_all = gather_rows(k, 2, plan, comm), gather_rows(v, 2, plan, comm)
    local = 0 if call.mask_rows == "local" else None
    return _attend(call, q, k_all, v_all, mask, call.q_order[comm.index], _all_rows(call.kv_order), local)


def _part(t: torch.Tensor, counts: tuple[int, ...], p: int, size: int, to_heads: bool) -> torch.Tensor:
    """What goes to rank ``p``: its head chunk of my rows (``to_heads``), or its rows of my head chunk (a view)."""
    if to_heads:
        h = t.shape[1] // size
        return t[:, p * h:(p + 1) * h]
    return t[:, :, offsets_of(counts)[p]:offsets_of(counts)[p] + counts[p]]


def _swap(comm: DomainComm, tensors: list[torch.Tensor], rows: list[tuple[int, ...]], to_heads: bool):
    """Rows -> heads (``to_heads``: (B, H, rows_me, E) becomes (B, H/D, all rows, E)) or back, for several
    tensors in one exchange; ``rows[i]``: every rank's rows of tensor i. Each result is filled in place from
    the messages (and this rank's own part), so only the messages are extra."""
    size, me = comm.size, comm.index
    shapes = []  # per tensor: the result's shape, and per peer the shape of the part it sends me
    for t, counts in zip(tensors, rows):
        b, h, _, e = t.shape
        if to_heads:
            shapes.append(((b, h // size, sum(counts), e), [(b, h // size, counts[p], e) for p in range(size)]))
        else:
            shapes.append(((b, h * size, counts[me], e), [(b, h, counts[me], e)] * size))
    outgoing, incoming = [], []
    for p in range(size):
        if p != me:
            outgoing.append((p, torch.cat([_part(t, c, p, size, to_heads).reshape(-1) for t, c in zip(tensors, rows)])))
            numel = sum(torch.Size(parts[p]).numel() for _, parts in shapes)
            incoming.append((p, tensors[0].new_empty(numel)))
    start_exchange(comm, outgoing, incoming, exchange_point(comm)).wait()
    del outgoing
    received = dict(incoming)
    results = [tensors[0].new_empty(shape) for shape, _ in shapes]
    for p in range(size):
        at = 0
        for i, ((_, parts), t, counts) in enumerate(zip(shapes, tensors, rows)):
            n = torch.Size(parts[p]).numel()
            part = _part(t, counts, me, size, to_heads) if p == me else received[p][at:at + n].view(parts[p])
            at += n
            _part(results[i], rows[i], p, size, not to_heads).copy_(part)
    return results


class _SwapHeadsRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: DomainComm, rows: list[tuple[int, ...]], to_heads: bool, *tensors):
        ctx.comm, ctx.rows, ctx.to_heads = comm, rows, to_heads
        return tuple(_swap(comm, list(tensors), rows, to_heads))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *_swap(ctx.comm, list(grads), ctx.rows, not ctx.to_heads))


def ulysses_attention(call: AttentionCall, q, k, v, mask) -> torch.Tensor:
    """All-to-all to heads, SDPA over every row of ``H/D`` heads, all-to-all back (see the module docstring).

    Usage: ``out = ulysses_attention(call, q, k, v, None)  # q/k/v heads divisible by the domain size``
    """
    comm = call.comm
    q_rows = tuple(seg.rows for seg in call.q_order)
    kv_rows = tuple(seg.rows for seg in call.kv_order)
    qh, kh, vh = _SwapHeadsRows.apply(comm, [q_rows, kv_rows, kv_rows], True, q, k, v)
    heads = q.shape[1] // comm.size
    if mask is not None and mask.ndim >= 3 and mask.shape[-3] != 1:
        mask = mask[..., comm.index * heads:(comm.index + 1) * heads, :, :]
    out = _attend(call, qh, kh, vh, mask, _all_rows(call.q_order), _all_rows(call.kv_order), None)
    (back,) = _SwapHeadsRows.apply(comm, [q_rows], False, out)
    return back

