"""The one-round halo plan on blocks (``mesh3d.domain.blocks_halo.plan_box``), checked in one process: every
rank's messages, sent as planned and assembled as planned, give exactly the rows its windows read, and what
each rank plans to send a peer is what that peer plans to receive. The multi-rank runs (and the backward)
are in test_domain_blocks.py."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh3d.domain.blocks import halo_rows_only
from mesh3d.domain.blocks_halo import _box, _pack, plan_box
from mesh3d.domain.halo import plan_window, window_output_length
from mesh3d.domain.split import offsets_of


@st.composite
def _layouts(draw):
    """A 2-D or 3-D grid, uneven sizes per grid dim (blocks of 0 and 1 rows included), a window per dim."""
    nd = draw(st.integers(2, 3))
    grid = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    sizes, windows = [], []
    for g in grid:
        sizes.append(tuple(draw(st.lists(st.integers(0, 4), min_size=g, max_size=g).filter(lambda s: sum(s) > 0))))
        kernel, dilation = draw(st.integers(1, 4)), draw(st.integers(1, 2))
        reach = dilation * (kernel - 1)
        pad = draw(st.integers(0, reach))
        windows.append((kernel, draw(st.integers(1, 2)), dilation, pad, draw(st.integers(0, reach))))
    return grid, tuple(sizes), windows


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_one_round_plans_deliver_exactly_the_rows_each_window_reads(layout):
    grid, sizes, windows = layout
    if any(window_output_length(sum(s), *w) <= 0 for s, w in zip(sizes, windows)):
        return  # the window does not fit (plan_window refuses it, as torch would)
    shape = tuple(sum(s) for s in sizes)
    dims = tuple(range(1, 1 + len(grid)))
    whole = torch.arange(3 * torch.Size(shape).numel(), dtype=torch.float64).reshape(3, *shape)
    coords_all = list(itertools.product(*(range(g) for g in grid)))
    plans, blocks, wants = {}, {}, {}
    for coords in coords_all:
        xplans, rows = [], []
        for s, w, c in zip(sizes, windows, coords):
            window = plan_window(s, *w)
            xplans.append(halo_rows_only(s, window, c)[0])
            rows.append([r for span in window.needs[c] if not span.is_fill for r in range(span.start, span.stop)])
        rank = coords_all.index(coords)  # row-major, as the domain group orders its ranks
        plans[rank] = plan_box(tuple(xplans), coords, grid)
        box = [(offsets_of(s)[c], s[c]) for s, c in zip(sizes, coords)]
        blocks[rank] = _box(whole, dims, box)
        want = whole
        for d, r in zip(dims, rows):
            want = want.index_select(d, torch.tensor(r, dtype=torch.long))
        wants[rank] = want
    for me, plan in plans.items():
        messages = {}
        for peer, lengths in plan.recv:
            sent = dict(plans[peer].send)[me]  # the peer plans to send me something: the same box I expect
            messages[peer] = _pack(blocks[peer], dims, sent)
            assert tuple(messages[peer].shape[1:]) == lengths
        assert all(me in dict(plans[peer].recv) for peer, _ in plan.send)  # and nobody is sent what it won't take
        out = torch.full((3, *plan.shape), float("nan"), dtype=torch.float64)
        for peer, (result, source) in plan.cells:
            _box(out, dims, result).copy_(_box(blocks[me] if peer < 0 else messages[peer], dims, source))
        assert torch.equal(out, wants[me]), (me, grid, sizes, windows)
