"""The one-round exchange on blocks (``mesh3d.domain.halo.boxes``). In one process: every rank's messages,
sent as planned and assembled as planned, give exactly the rows its windows read (fill rows included), and
what each rank plans to send a peer is what that peer plans to receive. On ranks: padding modes, transposed
convolutions and upsampling against one process, in one round. Convolutions and pooling on ranks (halo bytes,
rounds, training) are in test_domain_blocks.py."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from domain_cases import domain_sum, max_err
from mesh3d import DistributedManager, domain
from mesh3d.domain.layouts.blocks import halo_rows_only
from mesh3d.domain.halo.boxes import FILL, OWN, _box, _pack, plan_box
from mesh3d.domain.halo.windows import plan_window, window_output_length
from mesh3d.domain.comm.rows import plan_exchange
from mesh3d.domain.core.split import offsets_of
from profiles import examples


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
    return grid, tuple(sizes), windows, draw(st.booleans())


@settings(max_examples=examples(150), deadline=None)
@given(_layouts())
# Every run, whatever is drawn: one-row blocks, empty blocks first, inside and last, on 2-D and 3-D grids.
@example(((2, 3), ((1, 7), (0, 5, 0)), [(3, 1, 1, 1, 1), (3, 2, 2, 2, 1)], False))
@example(((2, 3), ((1, 7), (0, 5, 0)), [(3, 1, 1, 1, 1), (3, 2, 2, 2, 1)], True))
@example(((3, 2, 2), ((1, 0, 4), (0, 3), (3, 0)), [(3, 1, 1, 1, 1), (2, 1, 1, 1, 0), (4, 2, 1, 0, 3)], True))
def test_one_round_plans_deliver_exactly_the_rows_each_window_reads(layout):
    """Halo-only plans (window ops: the kernel pads) or whole row maps with fill rows (transposed conv, F.pad)."""
    grid, sizes, windows, with_fill = layout
    # the window must fit (plan_window refuses it otherwise, as torch would)
    assume(all(window_output_length(sum(s), *w) > 0 for s, w in zip(sizes, windows)))
    shape = tuple(sum(s) for s in sizes)
    dims = tuple(range(1, 1 + len(grid)))
    whole = torch.arange(3 * torch.Size(shape).numel(), dtype=torch.float64).reshape(3, *shape)
    padded = torch.full((3, *(n + 1 for n in shape)), -7.0, dtype=torch.float64)  # row n along each dim: the fill
    padded[(slice(None), *(slice(0, n) for n in shape))] = whole
    coords_all = list(itertools.product(*(range(g) for g in grid)))
    plans, blocks, wants = {}, {}, {}
    for coords in coords_all:
        xplans, rows = [], []
        for s, w, c in zip(sizes, windows, coords):
            window = plan_window(s, *w)
            xplans.append(plan_exchange(s, window.needs, c) if with_fill else halo_rows_only(s, window, c)[0])
            rows.append([sum(s) if span.is_fill else r for span in window.needs[c] if with_fill or not span.is_fill
                         for r in range(span.start, span.stop)])
        rank = coords_all.index(coords)  # row-major, as the domain group orders its ranks
        plans[rank] = plan_box(tuple(xplans), coords, grid)
        box = [(offsets_of(s)[c], s[c]) for s, c in zip(sizes, coords)]
        blocks[rank] = _box(whole, dims, box)
        want = padded
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
            if peer == FILL:
                _box(out, dims, result).fill_(-7.0)
            else:
                _box(out, dims, result).copy_(_box(blocks[me] if peer == OWN else messages[peer], dims, source))
        assert torch.equal(out, wants[me]), (me, grid, sizes, windows)


def _resample_body(grid, shape, sizes):
    """F.pad in every mode, transposed convs and interpolation on blocks vs one process (fp64): values, input and
    weight gradients, and how many exchange rounds each forward took."""
    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    weight = torch.randn(3, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    ops = {
        "pad constant 2.5": lambda t: F.pad(t, (2, 1, 1, 3), value=2.5),
        "pad reflect": lambda t: F.pad(t, (1, 2, 2, 1), mode="reflect"),
        "pad replicate": lambda t: F.pad(t, (3, 0, 0, 2), mode="replicate"),
        "pad circular": lambda t: F.pad(t, (2, 2, 1, 2), mode="circular"),
        "conv_transpose2d": lambda t: F.conv_transpose2d(t, weight, stride=(2, 3), padding=1, output_padding=(1, 0)),
        "upsample bilinear": lambda t: F.interpolate(t, scale_factor=(2.0, 1.5), mode="bilinear"),
        "downsample bilinear": lambda t: F.interpolate(t, size=(shape[0] - 2, shape[1] - 3), mode="bilinear",
                                                       align_corners=True),
    }
    out = {}
    for name, op in ops.items():
        x = torch.randn(2, 3, *shape, dtype=torch.float64, requires_grad=True)
        y = op(x)
        cotangent = torch.randn_like(y)
        (y * cotangent).sum().backward()
        weight_grad, weight.grad = weight.grad, None
        xi = x.detach().requires_grad_(True)
        with domain.count_traffic() as traffic:
            ys = op(domain.shard(xi, dims=(2, 3), sizes=sizes))
        (ys * domain.shard(cotangent, dims=(2, 3), sizes=tuple(ys.spec.sizes))).sum().backward()
        errs = [max_err(ys.full_tensor().to_local(), y), max_err(domain_sum(xi.grad), x.grad)]
        if weight_grad is not None:
            errs.append(max_err(domain_sum(weight.grad), weight_grad))
            weight.grad = None
        out[name] = (max(errs), traffic.rounds)
    return out


def test_padding_transposed_convs_and_upsampling_on_blocks_take_one_round(ranks):
    most_rounds: dict[str, int] = {}
    for grid, shape, sizes in (((2, 3), (7, 8), ((4, 3), (1, 5, 2))), ((2, 2), (6, 5), ((6, 0), (1, 4)))):
        results = ranks.run(grid[0] * grid[1], _resample_body, grid, shape, sizes)
        for name in results[0]:
            assert max(r[name][0] for r in results) < 1e-12, (name, grid, sizes, results)
            most_rounds[name] = max(most_rounds.get(name, 0), *(r[name][1] for r in results))
    # every block dim and the corners at once (one pass per grid dim takes 2 where both dims move rows);
    # constant and replicate padding only grow the edge blocks: nothing travels
    most_rounds.pop("downsample bilinear")  # one grid dim after the other (sends rows shrunk along the first)
    assert most_rounds == {"pad constant 2.5": 0, "pad reflect": 1, "pad replicate": 0, "pad circular": 1,
                           "conv_transpose2d": 1, "upsample bilinear": 1}, most_rounds
