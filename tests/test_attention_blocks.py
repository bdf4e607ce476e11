"""Ring attention's pieces in one process (no ranks): block kernels, skip/full/masked pieces, the ring's merge,
zigzag layouts and their causal work balance, relayout plans. fp64 against torch's SDPA."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from profiles import examples

from mesh3d.domain.attention.score_tiles import MaskRule, Segment, tile_mask, tile_work, tiles
from mesh3d.domain.attention.row_order import _needs, slab_order, zigzag_order
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.attention.ring import RING_STATS, RingPlan, ring_attention
from mesh3d.domain.core.split import balanced_sizes

ONE = DomainComm(None, (0,), 0)


def _visible(qi: torch.Tensor, ki: torch.Tensor, rule: MaskRule) -> torch.Tensor:
    mask = torch.ones(len(qi), len(ki), dtype=torch.bool)
    if rule.right is not None:
        mask &= ki[None] <= qi[:, None] + rule.right
    if rule.left is not None:
        mask &= ki[None] >= qi[:, None] - rule.left
    return mask


def _segment(draw, n: int) -> Segment:
    """Some rows of 0..n in a shuffled run order (a token grid's block rows, a zigzag's chunks)."""
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
    runs = [(a, b) for a, b in zip([0, *cuts], [*cuts, n]) if b > a]
    runs = draw(st.permutations(runs))
    keep = draw(st.lists(st.booleans(), min_size=len(runs), max_size=len(runs)))
    return Segment(tuple(r for r, k in zip(runs, keep) if k))


RULES = st.sampled_from([MaskRule(), MaskRule(None, 0), MaskRule(3, 0), MaskRule(2, 5), MaskRule(0, 0),
                         MaskRule(None, 2), MaskRule(4, None)])


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), rule=RULES)
def test_pieces_cover_exactly_the_visible_pairs(data, rule):
    """Pieces (with their masks and causal flags) mark each visible (query, key) pair once and nothing else."""
    q, k = _segment(data.draw, 20), _segment(data.draw, 20)
    want = _visible(q.index(), k.index(), rule)
    got = torch.zeros(q.rows, k.rows, dtype=torch.int64)
    for p in tiles(q, k, rule):
        m = tile_mask(p, q, k, rule, None, None, "cpu")
        block = torch.ones(p.q1 - p.q0, p.k1 - p.k0, dtype=torch.bool) if m is None else m
        if p.causal:
            block = block & torch.ones_like(block).tril()
        got[p.q0:p.q1, p.k0:p.k1] += block.long()
    assert (got <= 1).all() and torch.equal(got.bool(), want)


def _reference(q, k, v, mask, rule, gqa):
    vis = _visible(torch.arange(q.shape[-2]), torch.arange(k.shape[-2]), rule)
    if mask is not None:
        vis = (mask & vis) if mask.dtype == torch.bool else mask.masked_fill(~vis, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis, enable_gqa=gqa)


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data(), rule=RULES, math=st.booleans(), gqa=st.booleans(), mask_kind=st.sampled_from([None, "bool", "float"]),
       groups=st.integers(1, 3))
def test_one_rank_ring_equals_sdpa_in_any_row_order(data, rule, math, gqa, mask_kind, groups):
    """The ring's merge over pieces, run on one rank with rows in a shuffled block order, equals SDPA: output and
    gradients of q, k, v and a float mask (rows no key is visible to give 0, as torch does)."""
    n = data.draw(st.integers(1, 16))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    heads, kv_heads = 4, 2 if gqa else 4
    q, k, v = (torch.randn(2, h, n, 3, dtype=torch.float64, generator=gen, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(1, heads, n, n, generator=gen) > 0.4
    elif mask_kind == "float":
        mask = torch.randn(2, 1, n, n, dtype=torch.float64, generator=gen).requires_grad_(True)
    rule = MaskRule(rule.left, rule.right, mask is not None)
    ref = _reference(q, k, v, mask, rule, gqa)
    cot = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    want = torch.autograd.grad((ref * cot).sum(), [t for t in (q, k, v, mask) if t is not None and t.requires_grad])
    order = _segment(data.draw, n)
    order = Segment(order.runs + tuple(_complement(order, n)))  # every row once, in a shuffled run order
    idx = order.index()
    plan = RingPlan(ONE, (order,), (order,), rule, 3 ** -0.5, "global" if mask is not None else None, groups, math)
    out = ring_attention(plan, q[:, :, idx], k[:, :, idx], v[:, :, idx], mask)
    got = torch.autograd.grad((out * cot[:, :, idx]).sum(), [t for t in (q, k, v, mask) if t is not None and t.requires_grad])
    assert torch.allclose(out, ref[:, :, idx], rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _complement(seg: Segment, n: int) -> list[tuple[int, int]]:
    taken = torch.zeros(n, dtype=torch.bool)
    taken[seg.index()] = True
    return list(Segment.joined((int(i), int(i) + 1) for i in torch.nonzero(~taken).flatten()).runs)


def _work(q_order, kv_order, rule) -> tuple[list[int], list[list[int]]]:
    """Per rank: total (query, key) pairs computed, and per ring step (rank r holds rank r - t's block at step t)."""
    d = len(q_order)
    steps = [[sum(tile_work(p) for p in tiles(q_order[r], kv_order[(r - t) % d], rule)) for t in range(d)]
             for r in range(d)]
    return [sum(s) for s in steps], steps


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(d):
    """The zigzag layout gives every rank the same causal work within 1.05 (max/mean) and every ring step too;
    contiguous slabs are far off ((2D-1)/D)."""
    causal = MaskRule(None, 0)
    for n in (64 * d, 64 * d + 5, 1000 + d, 4096):
        zig = zigzag_order(n, d)
        assert sorted(r for s in zig for r in s.index().tolist()) == list(range(n))
        totals, steps = _work(zig, zig, causal)
        assert max(totals) / (sum(totals) / d) <= 1.05, (n, totals)
        per_step = [max(s[t] for s in steps) for t in range(d)]  # a step lasts as long as its busiest rank
        assert sum(per_step) / (sum(totals) / d) <= 1.05, (n, steps)
        slabs = slab_order(balanced_sizes(n, d))
        plain, _ = _work(slabs, slabs, causal)
        assert max(plain) / (sum(plain) / d) > 1.3


@settings(max_examples=examples(100), deadline=None)
@given(data=st.data())
def test_relayout_plan_reads_the_rows_each_rank_needs(data):
    """``_needs`` maps a destination layout's runs into the source layout read rank after rank."""
    n, d = data.draw(st.integers(0, 30)), data.draw(st.integers(1, 4))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=d - 1, max_size=d - 1)))
    sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n]))
    src, dst = data.draw(st.sampled_from([(slab_order(sizes), zigzag_order(n, d)),
                                          (zigzag_order(n, d), slab_order(sizes))]))
    source_order = torch.cat([s.index() for s in src]) if n else torch.zeros(0, dtype=torch.long)
    rows, needs = _needs(src, dst)
    assert rows == tuple(s.rows for s in src)
    for seg, need in zip(dst, needs):
        got = [int(source_order[i]) for span in need for i in range(span.start, span.stop)]
        assert got == seg.index().tolist()


def test_ring_stats_count_blocks_in_flight_on_one_rank():
    """One rank sends nothing; the block being computed on is the only one held."""
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    plan = RingPlan(ONE, (Segment.run(0, 5),), (Segment.run(0, 5),), MaskRule(None, 0), 0.5)
    RING_STATS.reset()
    ring_attention(plan, q, q, q)
    assert RING_STATS.messages == 0 and RING_STATS.max_in_flight_bytes == q.numel() * 8 * 2
    assert RING_STATS.work == 2 * 15  # 5 rows, causal: 1 + 2 + ... + 5 pairs per (batch, head), 2 heads


def test_segment_helpers():
    seg = Segment.joined([(0, 3), (3, 5), (8, 8), (9, 12)])
    assert seg.runs == ((0, 5), (9, 12)) and seg.rows == 8 and (seg.lo, seg.hi) == (0, 12)
    assert seg.start_of(1, 4) == 1 and seg.start_of(4, 6) is None and seg.start_of(5, 8) == 9
    assert list(itertools.chain(*seg.runs)) == [0, 5, 9, 12]
