"""Convolutions on blocks with their halos overlapped (``mesh3d.domain.layouts.blocks_overlap``), against one process (fp64):
conv stacks on 2x2, 2x3 and 2x2x2 grids (uneven sizes, empty blocks, stride, dilation, 'same'), a few SGD steps
with overlap on and off, the overlap really running, and halo bytes at the geometric minimum."""

from __future__ import annotations

import contextlib
import copy
import itertools

import torch

from domain_cases import domain_sum, max_err, sum_grads_over_domain

TOL = 1e-10


def _stack(nd: int, layers) -> torch.nn.Module:
    conv = getattr(torch.nn, f"Conv{nd}d")
    mods, channels = [], 2
    for k, s, d, p in layers:
        mods += [conv(channels, 3, k, stride=s, padding=p, dilation=d, dtype=torch.float64), torch.nn.Tanh()]
        channels = 3
    return torch.nn.Sequential(*mods)


def _expected_overlaps(layers, shape, sizes, grid) -> int:
    """Convs this rank runs overlapped: those where some grid dim receives rows and has an interior (the 1-D split)."""
    from mesh3d import DistributedManager
    from mesh3d.domain.halo.windows import plan_window
    from mesh3d.domain.halo.overlap import split_window
    from mesh3d.domain.comm.rows import plan_exchange
    from mesh3d.domain.core.split import split_sizes

    dm = DistributedManager()
    me = [dm.axis_rank(f"domain_{i}") for i in range(len(grid))]
    layout = [split_sizes(n, g, s) for n, g, s in zip(shape, grid, sizes or [None] * len(grid))]
    count = 0
    for k, s, d, p in layers:
        pads = ((d * (k - 1)) // 2, d * (k - 1) - (d * (k - 1)) // 2) if p == "same" else (p, p)
        overlaps = False
        for i, lay in enumerate(layout):
            plan = plan_window(lay, k, s, d, *pads)
            full = plan_exchange(lay, plan.needs, me[i])
            split = split_window(full, 0, d * (k - 1) + 1, s, plan.out_sizes[me[i]])
            overlaps |= bool(full.recv) and split is not None
            layout[i] = plan.out_sizes
        count += overlaps
    return count


def _stacks_body(grid, cases, steps):
    """Each case (nd, spatial shape, sizes per grid dim, layers): SGD steps vs one process, overlap on and off."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.halo.overlap import OVERLAP_STATS

    DistributedManager.initialize(batch=1, domain=grid)
    worst, calls, expected = 0.0, [], []
    dims = tuple(range(2, 2 + len(grid)))
    for i, (nd, shape, sizes, layers) in enumerate(cases):
        torch.manual_seed(i)
        ref0 = _stack(nd, layers)
        for enabled in (True, None, False):  # None: the default, which is off on blocks
            ref, mod = copy.deepcopy(ref0), copy.deepcopy(ref0)
            opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
            before = OVERLAP_STATS.calls
            for step in range(steps):
                x = torch.randn(2, 2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
                x.requires_grad_(True)
                y = ref(x)
                cot = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(99 + step))
                (y * cot).sum().backward()
                xi = x.detach().requires_grad_(True)
                with domain.window_overlap(enabled) if enabled is not None else contextlib.nullcontext():
                    full = mod(domain.shard(xi, dims=dims, sizes=sizes)).full_tensor().to_local()
                    (full * cot).sum().backward()
                worst = max(worst, max_err(full, y), max_err(domain_sum(xi.grad), x.grad))
                sum_grads_over_domain(mod.parameters())
                for p, q in zip(ref.parameters(), mod.parameters()):
                    worst = max(worst, max_err(p.grad, q.grad))
                opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
            worst = max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))
            calls.append(OVERLAP_STATS.calls - before)
        expected += [steps * _expected_overlaps(layers, shape, sizes, grid), 0, 0]
    return worst, calls, expected


SAME_THEN_STRIDED = [(3, 1, 1, "same"), (3, 2, 2, 1), (2, 1, 1, "same")]


def _check(results):
    assert max(r[0] for r in results) < TOL, results
    assert all(r[1] == r[2] for r in results), results  # overlap ran exactly where the split applies, never when off
    assert sum(sum(r[1]) for r in results) > 0, results


def test_2d_conv_stacks_on_2x2_blocks_equal_one_process(ranks):
    cases = [(2, (12, 11), None, SAME_THEN_STRIDED),
             (2, (13, 10), ((9, 4), (3, 7)), [(3, 1, 2, 2), (1, 2, 1, 0), (3, 1, 1, 1)]),
             (2, (12, 10), ((12, 0), (6, 4)), [(3, 1, 1, 1), (5, 1, 1, "same")])]  # an empty block
    _check(ranks.run(4, _stacks_body, (2, 2), cases, 2))


def test_2d_conv_stacks_on_2x3_blocks_equal_one_process(ranks):
    cases = [(2, (11, 14), ((6, 5), (5, 0, 9)), SAME_THEN_STRIDED),
             (2, (10, 15), None, [(5, 2, 1, 2), (3, 1, 1, "same")])]
    _check(ranks.run(6, _stacks_body, (2, 3), cases, 2))


def test_3d_conv_stacks_on_2x2x2_blocks_equal_one_process(ranks):
    cases = [(3, (8, 9, 7), ((4, 4), (5, 4), (0, 7)), [(3, 1, 1, "same"), (3, 2, 1, 1)]),
             (3, (10, 10, 9), None, [(3, 1, 2, 2)])]
    _check(ranks.run(8, _stacks_body, (2, 2, 2), cases, 2))


def _halo_body(grid, shape, sizes, channels):
    """Bytes a 3^n 'same' conv's forward and backward send with overlap on, off, and the geometric minimum."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.halo.overlap import OVERLAP_STATS
    from mesh3d.domain.core.split import offsets_of, split_sizes

    dm = DistributedManager.initialize(batch=1, domain=grid)
    nd = len(grid)
    conv = getattr(torch.nn, f"Conv{nd}d")(channels, channels, 3, padding=1, dtype=torch.float64)
    x = torch.randn(1, channels, *shape, dtype=torch.float64, requires_grad=True)
    sent, calls = [], OVERLAP_STATS.calls
    for enabled in (True, False):
        with domain.window_overlap(enabled):
            xs = domain.shard(x, dims=tuple(range(2, 2 + nd)), sizes=sizes)
            with domain.count_traffic() as forward:
                y = conv(xs)
            total = y.sum()
            with domain.count_traffic() as backward:
                total.backward()
        sent.append((forward.bytes_sent, backward.bytes_sent))
    layout = [split_sizes(n, g, s) for n, g, s in zip(shape, grid, sizes or [None] * nd)]
    me = [dm.axis_rank(f"domain_{i}") for i in range(nd)]
    mine = set(itertools.product(*[range(offsets_of(lay)[i], offsets_of(lay)[i] + lay[i]) for lay, i in zip(layout, me)]))
    footprint = {tuple(p + a for p, a in zip(point, step)) for point in mine
                 for step in itertools.product((-1, 0, 1), repeat=nd)}
    footprint = {p for p in footprint if all(0 <= v < n for v, n in zip(p, shape))}
    return sent, len(footprint - mine) * channels * 8, OVERLAP_STATS.calls - calls


def test_overlapped_halo_bytes_on_blocks_are_the_geometric_minimum(ranks):
    for grid, shape, sizes in (((2, 2), (10, 12), None), ((2, 2), (11, 9), ((4, 7), (6, 3))),
                               ((2, 2, 2), (6, 7, 6), ((3, 3), (4, 3), (2, 4)))):
        results = ranks.run(len(list(itertools.product(*map(range, grid)))), _halo_body, grid, shape, sizes, 2)
        minimum = sum(r[1] for r in results)
        for on_off in (0, 1):  # everything received was sent once, and backward returns the same rows
            assert sum(r[0][on_off][0] for r in results) == minimum, results
            assert sum(r[0][on_off][1] for r in results) == minimum, results
        assert all(r[2] == 1 for r in results), results  # every block has an interior here: overlapped once
