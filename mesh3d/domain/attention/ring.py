"""Ring attention over the domain group: K/V blocks travel rank to rank while each rank computes on the one it holds.

Usage::

    plan = RingPlan(comm, queries=(Segment.run(off, off + n),), keys=segments_per_rank, rule=MaskRule(None, 0),
                    scale=hd ** -0.5)
    out = ring_attention(plan, q, k, v)              # plain local tensors (B, H, rows, E); differentiable

Forward: each rank packs its keys and values into one block. At step ``t`` it holds the block of domain rank
``me - t``, sends it on to ``me + 1`` and receives the next from ``me - 1`` (posted before the compute, waited
after it: double buffering, so at most two blocks are in flight), and folds the block's partial result into
its queries' output by log-sum-exp (``attention_kernel.merge_into``). Which (query, key) pairs meet comes from
global indices (``attention_blocks.pieces``): blocks no query sees are skipped, so a causal or banded ring
computes only what the mask keeps, on uneven and empty shards alike.

Backward: a ring too. The K/V blocks go round again (prefetched the same way), each rank adds its queries'
share of every block's key/value gradient into an accumulator that travels with the block, and after the
last step the accumulator takes one more hop home. dQ stays local. Each block's backward uses the merged
output and log-sum-exp, so the gradients are the one-process ones.

In a dry run (``mesh3d.planner``, meta tensors) without a user mask the blocks are not computed one by one:
each pass allocates its buffers and, for a moment, its largest kernel call's workspace, and reports every
exchange it would post (``_forward_modeled``): the same bytes and messages in a fraction of the ops.

Heads are independent: ``head_groups`` runs the ring over groups of K/V heads one after the other, so the
blocks in flight (and the backward's accumulators) are that much smaller. A plain float mask that requires
grad gets this rank's rows of its gradient (a partial sum, added over the domain like a parameter's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mesh3d.domain.attention.score_tiles import MaskRule, Segment, tile_mask, tile_work, tiles
from mesh3d.domain.attention.backends import BLOCK_KERNELS, BlockKernels
from mesh3d.domain.attention.collect import recorded_attention_grads
from mesh3d.domain.attention.kernels import accumulation_dtype, block_backward, block_forward, merge_into, unit_stride
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import PendingExchange, TrafficCounter, exchange_point, start_exchange
from mesh3d.domain.attention.workspace import BlockShape, block_workspace
from mesh3d.domain.core.split import balanced_sizes, offsets_of
from mesh3d.domain.comm.traffic import dry_run_observer

__all__ = ["RING_STATS", "RingPlan", "RingStats", "ring_attention"]


@dataclass(frozen=True)
class RingPlan:
    """What one ring attention call needs besides its tensors (plain, hashable data).

    ``queries``: this rank's query rows, as segments in local order (two for the causal zigzag); ``keys``:
    every domain rank's key/value rows, one segment each; ``mask_rows``: how a user mask's rows are read,
    ``"global"`` (a ``(..., S, S)`` mask) or ``"local"`` (rows sharded like the queries); ``math``: use the
    explicit math kernel instead of torch's fused one.
    """

    comm: DomainComm
    queries: tuple[Segment, ...]
    keys: tuple[Segment, ...]
    rule: MaskRule
    scale: float
    mask_rows: str | None = None
    head_groups: int = 1
    math: bool = False


class RingStats:
    """What the rings in this process did since ``reset()``: the most K/V bytes held in transit at once
    (``max_in_flight_bytes``: the block being computed on plus the one arriving), the most gradient
    accumulator bytes in transit (``max_grad_in_flight_bytes``), messages sent, and the (query, key) pairs
    this rank computed in forward (``work``, over batch and heads).

    Usage: ``RING_STATS.reset(); out = attention(...); RING_STATS.work``
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.max_in_flight_bytes = 0
        self.max_grad_in_flight_bytes = 0
        self.messages = 0
        self.work = 0


RING_STATS = RingStats()


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _head_groups(groups: int, kv_heads: int, q_heads: int) -> Iterator[tuple[slice, slice]]:
    """(K/V heads, query heads) of each group; a query head's K/V head is ``h // (q_heads // kv_heads)``."""
    per = q_heads // kv_heads
    for a, n in zip(offsets_of(balanced_sizes(kv_heads, max(1, min(groups, kv_heads)))),
                    balanced_sizes(kv_heads, max(1, min(groups, kv_heads)))):
        yield slice(a, a + n), slice(a * per, (a + n) * per)


def _mask_heads(mask: torch.Tensor | None, heads: slice, q_heads: int) -> torch.Tensor | None:
    if mask is None or mask.ndim < 3 or mask.shape[-3] == 1 or q_heads == 1:
        return mask
    return mask[..., heads, :, :]


class _Pass:
    """Blocks going round the ring: ``start(block, rows)`` posts the send of ``block`` to the next rank and the
    receive of the previous rank's (``rows`` long) and returns its buffer; ``finish()`` waits for both. The first
    exchange of a pass checks the peers' headers (divergence detection); waits are bounded by the group timeout."""

    def __init__(self, comm: DomainComm) -> None:
        self.comm = comm
        self.next, self.prev = (comm.index + 1) % comm.size, (comm.index - 1) % comm.size
        self.first = True
        self._pending: PendingExchange | None = None

    def start(self, block: torch.Tensor, incoming_rows: int) -> torch.Tensor:
        shape = list(block.shape)
        shape[-2] = incoming_rows
        incoming = block.new_empty(shape)
        point = exchange_point(self.comm) if self.first else None
        self.first = False
        self._pending = start_exchange(self.comm, [(self.next, block)], [(self.prev, incoming)], point)
        RING_STATS.messages += int(block.numel() > 0)
        return incoming

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def _all_masked(mask: torch.Tensor | None) -> bool:
    if mask is None:
        return False
    return not bool(mask.any()) if mask.dtype == torch.bool else bool((mask == float("-inf")).all())


def _query_segments(plan: RingPlan) -> Iterator[tuple[Segment, int]]:
    """Each query segment with its first local row."""
    at = 0
    for seg in plan.queries:
        yield seg, at
        at += seg.rows


def _blocks(plan: RingPlan, src: int, mask: torch.Tensor | None, device):
    """Every kernel call on the block of rank ``src``: (query rows, key rows, causal flag, mask), skips left out."""
    kseg = plan.keys[src]
    for qseg, at in _query_segments(plan):
        for p in tiles(qseg, kseg, plan.rule):
            m = tile_mask(p, qseg, kseg, plan.rule, mask, at if plan.mask_rows == "local" else None, device)
            if not _all_masked(m):
                yield p, slice(at + p.q0, at + p.q1), slice(p.k0, p.k1), m, (qseg, kseg, at)


def _block_forward(plan: RingPlan, kernels: BlockKernels, src: int, block: torch.Tensor, width: int, qg, mg, og,
                   lg) -> None:
    """Fold the block of rank ``src`` into this rank's output (``og``/``lg``: views of one head group)."""
    for p, rows, cols, m, _ in _blocks(plan, src, mg, qg.device):
        RING_STATS.work += tile_work(p) * qg.shape[0] * qg.shape[1]
        o, lz = block_forward(qg[:, :, rows], block[:, :, cols, :width], block[:, :, cols, width:], m,
                              p.causal, plan.scale, plan.math, kernels)
        merge_into(og[:, :, rows], lg[:, :, rows], o, lz)


def _forward(plan: RingPlan, kernels: BlockKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None):
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    width, size, me = k.shape[-1], plan.comm.size, plan.comm.index
    for kv_heads, q_heads in _head_groups(plan.head_groups, k.shape[1], q.shape[1]):
        qg, mg, og, lg = q[:, q_heads], _mask_heads(mask, q_heads, q.shape[1]), out[:, q_heads], lse[:, q_heads]
        block, src, ring = torch.cat((k[:, kv_heads], v[:, kv_heads]), -1), me, _Pass(plan.comm)
        for t in range(size):
            incoming = ring.start(block, plan.keys[(me - t - 1) % size].rows) if t < size - 1 else None
            RING_STATS.max_in_flight_bytes = max(RING_STATS.max_in_flight_bytes,
                                                 _nbytes(block, *(() if incoming is None else (incoming,))))
            _block_forward(plan, kernels, src, block, width, qg, mg, og, lg)
            ring.finish()
            if incoming is not None:
                block, src = incoming, (me - t - 1) % size
    return out.to(q.dtype), lse


def _add_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, heads: slice, q_heads: int, piece, segs,
                   local_rows: bool) -> None:
    """Add a piece's score gradient into the user mask's gradient at the rows and columns it was sliced from."""
    qseg, kseg, at = segs
    target = _mask_heads(dmask, heads, q_heads)
    r_dim, c_dim = target.ndim - 2, target.ndim - 1
    rows_n = piece.q1 - piece.q0 if target.shape[r_dim] != 1 else 1
    cols_n = piece.k1 - piece.k0 if target.shape[c_dim] != 1 else 1
    shape = list(target.shape)
    shape[r_dim], shape[c_dim] = rows_n, cols_n
    g = ds.sum_to_size(shape).to(dmask.dtype)
    if target.shape[c_dim] != 1:
        start = kseg.start_of(piece.k0, piece.k1)
        if start is not None:
            target = target.narrow(c_dim, start, cols_n)
        else:
            spread = g.new_zeros((*shape[:c_dim], target.shape[c_dim]))
            g = spread.index_add_(c_dim, kseg.index(g.device)[piece.k0:piece.k1], g)
    start = at + piece.q0 if local_rows else qseg.start_of(piece.q0, piece.q1)
    if target.shape[r_dim] == 1:
        target.add_(g)
    elif start is not None:
        target.narrow(r_dim, start, rows_n).add_(g)
    else:
        target.index_add_(r_dim, qseg.index(g.device)[piece.q0:piece.q1], g)


def _block_backward(plan: RingPlan, kernels: BlockKernels, src: int, block, grads, width: int, want_dmask: bool,
                    dmask, heads: slice, q_heads: int, qg, dog, og, lg, mg, dqg) -> None:
    """Add the block of rank ``src``'s share of dQ (into ``dqg``), of its dK/dV (into ``grads``, which travels with
    it) and of the mask's gradient. NOTE: a function, so each piece's gradients are freed before the next exchange."""
    for p, rows, cols, m, segs in _blocks(plan, src, mg, qg.device):
        gq, gk, gv, ds = block_backward(dog[:, :, rows], qg[:, :, rows], block[:, :, cols, :width],
                                        block[:, :, cols, width:], og[:, :, rows], lg[:, :, rows], m,
                                        p.causal, plan.scale, want_dmask, plan.math, kernels)
        dqg[:, :, rows] += gq
        grads[:, :, cols, :width] += gk
        grads[:, :, cols, width:] += gv
        if dmask is not None:
            _add_mask_grad(dmask, ds, heads, q_heads, p, segs, plan.mask_rows == "local")


def _backward(plan: RingPlan, kernels: BlockKernels, dout, q, k, v, mask, out, lse, want_dmask: bool):
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
    dmask = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if want_dmask else None
    width, size, me = k.shape[-1], plan.comm.size, plan.comm.index
    for kv_heads, q_heads in _head_groups(plan.head_groups, k.shape[1], q.shape[1]):
        views = (q[:, q_heads], dout[:, q_heads], out[:, q_heads], lse[:, q_heads],
                 _mask_heads(mask, q_heads, q.shape[1]), dq[:, q_heads])
        block, src = torch.cat((k[:, kv_heads], v[:, kv_heads]), -1), me
        grads = torch.zeros(block.shape, dtype=acc, device=block.device)  # travels with the block
        ring, home = _Pass(plan.comm), _Pass(plan.comm)
        for t in range(size):
            incoming = ring.start(block, plan.keys[(me - t - 1) % size].rows) if t < size - 1 else None
            _block_backward(plan, kernels, src, block, grads, width, want_dmask, dmask, q_heads, q.shape[1], *views)
            ring.finish()
            if incoming is not None:  # the block was sent on: let it go before its gradients travel
                block, src = incoming, (me - t - 1) % size
            if size > 1:  # the accumulator follows its block; after the last step it goes home (to me + 1)
                arriving = home.start(grads, plan.keys[(me - t - 1) % size].rows)
                RING_STATS.max_grad_in_flight_bytes = max(RING_STATS.max_grad_in_flight_bytes, _nbytes(grads, arriving))
                home.finish()
                grads = arriving
        dk[:, kv_heads], dv[:, kv_heads] = grads[..., :width], grads[..., width:]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask


def _report_pass(plan: RingPlan, held: torch.Tensor, steps: int, rows: list[int]) -> torch.Tensor:
    """A modeled pass of ``steps`` exchanges: at step ``t`` the buffer of ``rows[t]`` rows goes to the next rank and
    one of ``rows[t + 1]`` arrives. Returns the arriving buffer at its largest (alive beside ``held``); the dry
    run's observer sees the pass's buffers once, the traffic counters see every step as ``start_exchange``'s."""
    comm, size = plan.comm, plan.comm.size
    shape = list(held.shape)
    shape[-2] = max(rows[(t + 1) % size] for t in range(steps))
    arriving = held.new_empty(shape)
    observer = dry_run_observer()
    if observer is not None:
        observer(comm, [((comm.index + 1) % size, held)] if held.numel() else [],
                 [((comm.index - 1) % size, arriving)] if arriving.numel() else [])
    per_row = math.prod(held.shape[:-2]) * held.shape[-1] * held.element_size()
    for t in range(steps):
        sent, got = rows[t] * per_row, rows[(t + 1) % size] * per_row
        if sent or got:
            TrafficCounter.record(sent, int(sent > 0), 0.0)
        RING_STATS.messages += int(sent > 0)
    return arriving


def _most_workspace(plan: RingPlan, kernels: BlockKernels, q_shape: tuple[int, ...], block: torch.Tensor, width: int,
                    backward: bool) -> int:
    """The most one kernel call on any block holds (``block_workspace``), over the pieces this rank computes."""
    most, work = _workspace_and_work(plan, kernels, q_shape[0], q_shape[1], block.shape[1], width,
                                     block.shape[-1] - width, block.dtype, backward)
    if not backward:
        RING_STATS.work += work
    return most


@functools.lru_cache(maxsize=4096)
def _workspace_and_work(plan: RingPlan, kernels: BlockKernels, batch: int, q_heads: int, kv_heads: int, width: int,
                        value_width: int, dtype: torch.dtype, backward: bool) -> tuple[int, int]:
    """(the largest kernel workspace, the (query, key) pairs computed) over every piece of this rank's ring.

    NOTE: cached: a dry run meets the same ring in every layer of every simulated step."""
    most = work = 0
    for kseg in plan.keys:
        for qseg in plan.queries:
            for p in tiles(qseg, kseg, plan.rule):
                work += tile_work(p) * batch * q_heads
                shape = BlockShape(batch, q_heads, kv_heads, p.q1 - p.q0, p.k1 - p.k0, width, value_width, dtype,
                                   p.causal, p.banded)
                most = max(most, block_workspace(shape, backward, kernels, plan.math))
    return most, work


def _spike(like: torch.Tensor, nbytes: int) -> None:
    """Allocate ``nbytes`` on ``like``'s device for a moment: what a dry run's memory tracker sees as the workspace."""
    torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def _forward_modeled(plan: RingPlan, kernels: BlockKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``_forward``'s outputs, buffers, workspace and traffic, without its kernels (a dry run's)."""
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    width, size, me = k.shape[-1], plan.comm.size, plan.comm.index
    rows = [plan.keys[(me - t) % size].rows for t in range(size)]
    for kv_heads, q_heads in _head_groups(plan.head_groups, k.shape[1], q.shape[1]):
        block = torch.cat((k[:, kv_heads], v[:, kv_heads]), -1)
        arriving = _report_pass(plan, block, size - 1, rows) if size > 1 else None
        RING_STATS.max_in_flight_bytes = max(RING_STATS.max_in_flight_bytes,
                                             _nbytes(block, *(() if arriving is None else (arriving,))))
        _spike(block, _most_workspace(plan, kernels, (q.shape[0], q_heads.stop - q_heads.start), block, width, False))
    return out.to(q.dtype), lse


def _backward_modeled(plan: RingPlan, kernels: BlockKernels, dout, q, k, v):
    """``_backward``'s outputs, buffers, workspace and traffic, without its kernels (a dry run's)."""
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
    width, size, me = k.shape[-1], plan.comm.size, plan.comm.index
    rows = [plan.keys[(me - t) % size].rows for t in range(size)]
    for kv_heads, q_heads in _head_groups(plan.head_groups, k.shape[1], q.shape[1]):
        block = torch.cat((k[:, kv_heads], v[:, kv_heads]), -1)
        grads = torch.zeros(block.shape, dtype=acc, device=block.device)
        buffers = []
        if size > 1:  # the blocks go round again; each accumulator follows its block and takes one more hop home
            buffers = [_report_pass(plan, block, size - 1, rows), _report_pass(plan, grads, size, rows)]
            RING_STATS.max_grad_in_flight_bytes = max(RING_STATS.max_grad_in_flight_bytes, _nbytes(grads, buffers[1]))
        _spike(block, _most_workspace(plan, kernels, (q.shape[0], q_heads.stop - q_heads.start), block, width, True))
        dk[:, kv_heads], dv[:, kv_heads] = grads[..., :width], grads[..., width:]
    del dout
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _modeled(mask: torch.Tensor | None) -> bool:
    """Whether this call is modeled (``_forward_modeled``) rather than computed: in a dry run, without a user mask.

    NOTE: a dry run with a user mask computes: the mask's values decide which blocks are skipped."""
    return mask is None and dry_run_observer() is not None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: RingPlan, q_in, k, v, mask):
        q = unit_stride(q_in)  # once here, not per block (the fused kernel needs it)
        ctx.modeled = _modeled(mask)
        # NOTE: the kernels in force now serve the backward too (autograd may run it on another thread)
        ctx.kernels = kernels = BLOCK_KERNELS.value
        out, lse = _forward_modeled(plan, kernels, q, k, v) if ctx.modeled else _forward(plan, kernels, q, k, v, mask)
        ctx.plan = plan
        ctx.save_for_backward(q if q is q_in else q_in, k, v, mask, out, lse)  # the input: connected when recorded
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        plan = ctx.plan
        if torch.is_grad_enabled() and not ctx.modeled:
            # NOTE: create_graph=True (second derivatives): the ring's kernels are not differentiable twice; the
            # gradients are computed again in recorded ops (all keys gathered, torch's math kernel).
            return None, *recorded_attention_grads(plan.comm, plan.queries, plan.keys, plan.rule, plan.scale,
                                                   plan.mask_rows, dout, q, k, v, mask)
        q = unit_stride(q)
        dout = unit_stride(dout)
        if ctx.modeled:
            return (None, *_backward_modeled(ctx.plan, ctx.kernels, dout, q, k, v))
        dq, dk, dv, dmask = _backward(ctx.plan, ctx.kernels, dout, q, k, v, mask, out, lse, ctx.needs_input_grad[4])
        return None, dq, dk, dv, dmask


def ring_attention(plan: RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of this rank's queries over every rank's keys/values (see the module docstring).

    Usage: ``out = ring_attention(plan, q, k, v, bias)  # q (B, H, rows, E); k, v (B, Hkv, rows, E)``

    ``mask``: None, bool or float, broadcastable to ``(B, H, rows, S)`` with ``S`` the global key length
    (``plan.mask_rows == "global"``: ``(..., S_q, S)`` rows by global index). Every domain rank must call it
    (the blocks pass through every rank), empty shards included.
    """
    return _RingAttention.apply(plan, q, k, v, mask)
