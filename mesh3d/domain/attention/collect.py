"""Attention modes that collect what one SDPA call needs, then run torch's own kernel: ``gather`` and ``ulysses``.

Usage (``mesh3d.domain.attention.modes`` picks one; tensors are plain local (B, H, rows, E))::

    out = gather_attention(call, q, k, v, mask)      # every rank gathers all keys/values: O(S) memory
    out = ulysses_attention(call, q, k, v, mask)     # all-to-all: heads/D of every row, then back

``gather`` keeps this rank's queries and gathers every key and value row (one exchange, differentiable: key
and value gradients go home). It is the fastest on short sequences and holds the whole K/V (O(S) per rank).
``ulysses`` (DeepSpeed Ulysses) swaps the sharding from rows to heads with one all-to-all (point-to-point,
uneven rows allowed), runs SDPA on all rows of ``H/D`` heads, and swaps back; it needs the query and K/V
heads to divide by the domain size. Masks (causal, windows, the user's) are read by global index, as in
the ring (``score_tiles``).

On CUDA every call reaches one of torch's fused kernels where a ring block of the same inputs would
(``_attend`` is the one SDPA call of both modes and of a one-rank domain): all rows against all keys with
``is_causal`` (Ulysses, D=1) runs flash for fp16/bf16 and memory-efficient for fp32; gather's queries of a later
rank, windows and user masks run with a mask (memory-efficient, the (rows x keys) mask in memory: gather is for
short sequences); grouped K/V heads reach flash, or with a mask or in fp32 memory-efficient with the heads
expanded (``_heads_for_a_fused_kernel``); fp64 runs math. Tested on the CPU with the CUDA kernels stood in for
(``tests/test_attention_kernels.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mesh3d.domain.attention.backends import BLOCK_KERNELS
from mesh3d.domain.attention.fused import heads_view
from mesh3d.domain.attention.score_tiles import MaskRule, Tile, Segment, tile_mask
from mesh3d.domain.attention.row_order import RowOrder
from mesh3d.domain.core.linear import linear_op
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import exchange_point, gather_rows, start_exchange
from mesh3d.domain.comm.rows import Span, plan_exchange
from mesh3d.domain.core.split import offsets_of

__all__ = ["AttentionCall", "gather_attention", "local_attention", "recorded_attention_grads", "ulysses_attention"]


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
    #: attend with no query rows too (a recorded gradient's graph then has the same shape on every rank)
    every_rank: bool = False


def _all_rows(layout: RowOrder) -> Segment:
    """Every rank's rows, rank after rank (the order an exchange of all rows delivers them in)."""
    return Segment.joined(r for seg in layout for r in seg.runs)


def _attend(call: AttentionCall, q, k, v, mask, qseg: Segment, kseg: Segment, q_offset: int | None):
    """Torch's SDPA of ``q`` (rows ``qseg``) over ``k``/``v`` (rows ``kseg``), the mask built from the indices."""
    rule = call.rule
    causal = rule.left is None and rule.right == 0 and qseg.runs == ((0, qseg.rows),) and \
        kseg.runs == ((0, kseg.rows),) and mask is None
    piece = Tile(0, qseg.rows, 0, kseg.rows, banded=rule.banded and not causal)
    m = tile_mask(piece, qseg, kseg, rule, mask, q_offset, q.device)
    if call.every_rank or not qseg.rows or not kseg.rows:
        # NOTE: also without query or key rows: torch's SDPA would return a constant there, so a second derivative's
        # graph would lack this rank's link to the keys gathered from its peers (their exchange would run without it)
        return _math_attention(q, k, v, m, causal, call.scale)
    k, v, gqa = _heads_for_a_fused_kernel(q, k, v, m, causal, call.gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=call.scale, enable_gqa=gqa)


def _heads_for_a_fused_kernel(q, k, v, m, causal: bool, gqa: bool):
    """(k, v, enable_gqa) for torch's SDPA: K/V heads expanded where, on CUDA, grouped heads would send the call to
    the math kernel (its (rows x keys) scores) and equal heads reach a fused one.

    NOTE: in torch 2.11-2.13 only flash (fp16/bf16 without a mask) groups query heads; a masked or fp32 call with
    grouped heads runs math, while the memory-efficient kernel takes it with the heads expanded (an O(keys) copy).
    """
    heads = q.shape[-3]
    kernels = BLOCK_KERNELS.value
    if not gqa or k.shape[-3] == heads or kernels.platform(q) != "cuda" or \
            kernels.choose(q, k, v, m, causal, True) != "math" or \
            kernels.choose(q, heads_view(k, heads), heads_view(v, heads), m, causal, False) == "math":
        return k, v, gqa
    groups = heads // k.shape[-3]
    return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3), False


def _math_attention(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """Softmax attention in explicit ops (torch's math kernel, whose rows no key is visible to give 0): differentiable
    to any order, and with a graph of the same shape when there are no query rows (torch's SDPA returns a constant)."""
    if k.shape[1] != q.shape[1]:  # grouped keys/values
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    visible = None
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        visible = mask if visible is None else visible & mask
    elif mask is not None:
        scores = scores + mask
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    seen = scores.amax(-1, keepdim=True) > float("-inf")
    return torch.where(seen, torch.softmax(scores.masked_fill(~seen, 0.0), -1), 0.0) @ v


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


def _swap_heads_rows(comm: DomainComm, rows: list[tuple[int, ...]], to_heads: bool, *tensors: torch.Tensor) -> tuple:
    """``_swap`` of ``tensors`` (differentiable: the swap back)."""
    return linear_op(lambda *t: tuple(_swap(comm, list(t), rows, to_heads)),
                     lambda *g: tuple(_swap(comm, list(g), rows, not to_heads)), *tensors)


def ulysses_attention(call: AttentionCall, q, k, v, mask) -> torch.Tensor:
    """All-to-all to heads, SDPA over every row of ``H/D`` heads, all-to-all back (see the module docstring).

    Usage: ``out = ulysses_attention(call, q, k, v, None)  # q/k/v heads divisible by the domain size``
    """
    comm = call.comm
    q_rows = tuple(seg.rows for seg in call.q_order)
    kv_rows = tuple(seg.rows for seg in call.kv_order)
    qh, kh, vh = _swap_heads_rows(comm, [q_rows, kv_rows, kv_rows], True, q, k, v)
    heads = q.shape[1] // comm.size
    if mask is not None and mask.ndim >= 3 and mask.shape[-3] != 1:
        mask = mask[..., comm.index * heads:(comm.index + 1) * heads, :, :]
    out = _attend(call, qh, kh, vh, mask, _all_rows(call.q_order), _all_rows(call.kv_order), None)
    (back,) = _swap_heads_rows(comm, [q_rows], False, out)
    return back



def recorded_attention_grads(comm: DomainComm, queries: tuple[Segment, ...], keys: RowOrder, rule: MaskRule,
                             scale: float, mask_rows: str | None, dout: torch.Tensor, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    """The gradients of this rank's attention (queries ``queries`` over every rank's ``keys``) for q, k, v and a float
    mask, in recorded ops: the ``gather`` mode in explicit ops, differentiated with ``create_graph=True``.

    Usage: from a ring's backward when it runs with ``create_graph=True`` (second derivatives through attention)
    """
    me = comm.index
    mine = Segment.joined(r for seg in queries for r in seg.runs)
    # NOTE: ``every_rank``: a rank without queries attends too (on no rows), so that its recorded gradients depend on
    # the gathered keys as every rank's do: the next backward then runs this gather's exchange on every rank.
    call = AttentionCall(comm, tuple(mine if r == me else Segment(()) for r in range(comm.size)), keys, rule, scale,
                         q.shape[1] != k.shape[1], mask_rows, every_rank=True)
    inputs = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    with torch.enable_grad():
        out = gather_attention(call, q, k, v, mask)
    grads = iter(torch.autograd.grad(out, inputs, dout, create_graph=True, allow_unused=True) if inputs else ())
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in (q, k, v, mask))
