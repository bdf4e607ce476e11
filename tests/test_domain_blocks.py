"""Blocks: a sample sharded over 2 or 3 dims of a factored domain grid, against one process (fp64).

Grid validation runs in process; the rest on the rank pool: shard / full_tensor, conv stacks with
norms and losses (forward, input and parameter gradients, SGD steps), halo bytes against the geometric
minimum, and refusals on every rank."""

from __future__ import annotations

import copy
import math
import itertools

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from domain_cases import domain_sum, domain_sums, edge_layouts, max_err, shard_sizes, sum_grads_over_domain
from mesh3d.mesh_shape import grid_factorizations, resolve_domain_grid
from profiles import examples

TOL = 1e-10


def test_grid_factorizations_multiply_to_the_size():
    assert grid_factorizations(4) == [(4,), (2, 2)]
    for n in (1, 6, 8, 12):
        grids = grid_factorizations(n)
        assert all(torch.tensor(g).prod() == n for g in grids) and len(set(grids)) == len(grids)
    assert (2, 2, 2) in grid_factorizations(8) and (2, 3) in grid_factorizations(6)


def test_a_grid_that_does_not_fit_names_the_grids_that_would():
    assert resolve_domain_grid(8, 2, (2, 2), 1) == (4, (2, 2))
    with pytest.raises(ValueError, match=r"domain grid \(2, 3\) has 6 ranks.*grids of the 4 domain ranks that fit: "
                                         r"\(4,\), \(2, 2\)"):
        resolve_domain_grid(8, 2, (2, 3), 1)
    with pytest.raises(ValueError, match="tuple of 1 to 3 positive sizes"):
        resolve_domain_grid(4, 1, (2, 0), 1)


def _net(nd: int, channels: int = 3) -> torch.nn.Module:
    conv = getattr(torch.nn, f"Conv{nd}d")
    return torch.nn.Sequential(
        conv(2, channels, 3, padding=1, dtype=torch.float64), torch.nn.GroupNorm(1, channels, dtype=torch.float64),
        torch.nn.GELU(),
        conv(channels, channels, 3, stride=2, padding=2, dilation=2, dtype=torch.float64),
        torch.nn.BatchNorm2d(channels, dtype=torch.float64) if nd == 2 else torch.nn.Identity(),
        torch.nn.Tanh(),
        conv(channels, 1, (2, 3, 1)[:nd] if nd > 1 else 2, padding="same", dtype=torch.float64),
    )


def _blocks_body(grid, cases, steps):
    """Each case: (nd, global spatial shape, sharded dims, sizes per dim). A few SGD steps vs one process."""
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=1, domain=grid)
    worst = 0.0
    for i, (nd, shape, dims, sizes) in enumerate(cases):
        torch.manual_seed(i)
        ref = _net(nd)
        mod = copy.deepcopy(ref)
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(mod.parameters(), lr=0.05)
        for step in range(steps):
            x = torch.randn(2, 2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            x.requires_grad_(True)
            target = torch.randn(2, 1, *shape, dtype=torch.float64)
            y = ref(x)
            loss_ref = torch.nn.functional.mse_loss(y, target[tuple(slice(0, n) for n in y.shape)])
            loss_ref.backward()
            xi = x.detach().requires_grad_(True)
            xs = domain.shard(xi, dims=dims, sizes=sizes)
            ys = mod(xs)
            ts = domain.shard(target[tuple(slice(0, n) for n in y.shape)].contiguous(), dims=dims,
                              sizes=tuple(ys.spec.sizes))
            loss = torch.nn.functional.mse_loss(ys, ts)
            loss.backward()
            worst = max(worst, abs(float(loss) - float(loss_ref)), max_err(ys.full_tensor().to_local(), y),
                        max_err(domain_sum(xi.grad), x.grad))
            sum_grads_over_domain(mod.parameters())
            opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
        worst = max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))
        worst = max(worst, max((max_err(p, q) for p, q in zip(ref.buffers(), mod.buffers())), default=0.0))
    return worst, dm.domain_grid


@settings(max_examples=examples(3), deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no slow shrinking
@given(data=st.data())
def test_2d_blocks_train_like_one_process(ranks, data):
    for grid in ((2, 2), (2, 3)):
        cases = []
        for _ in range(2):
            shape = (data.draw(st.integers(9, 14)), data.draw(st.integers(9, 14)))
            sizes = tuple(data.draw(shard_sizes(n, g)) for n, g in zip(shape, grid))
            cases.append((2, shape, (2, 3), sizes))
        # Every call: blocks of one row, and empty blocks (the last column, or both outer columns at 3).
        cases.append((2, (12, 10), (2, 3), (edge_layouts(12, grid[0])[0], edge_layouts(10, grid[1])[-1])))
        results = ranks.run(grid[0] * grid[1], _blocks_body, grid, cases, 3)
        assert all(r[1] == grid for r in results)
        assert max(r[0] for r in results) < TOL, results


def test_3d_blocks_on_a_2x2x2_grid_train_like_one_process(ranks):
    cases = [(3, (9, 10, 8), (2, 3, 4), ((5, 4), (6, 4), (3, 5))), (3, (8, 7, 9), (4, 2, 3), None)]
    results = ranks.run(8, _blocks_body, (2, 2, 2), cases, 2)
    assert max(r[0] for r in results) < TOL, results


def _halo_body(shape, sizes, channels):
    """Bytes one 3x3(x3) 'same' conv's forward and backward send on a 2x2 (2x2x2) grid, and the geometric minimum."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.split import offsets_of, split_sizes

    grid = (2,) * len(shape)
    dm = DistributedManager.initialize(batch=1, domain=grid)
    conv = (torch.nn.Conv2d if len(shape) == 2 else torch.nn.Conv3d)(channels, channels, 3, padding=1,
                                                                       dtype=torch.float64)
    x = torch.randn(1, channels, *shape, dtype=torch.float64, requires_grad=True)
    dims = tuple(range(2, 2 + len(shape)))
    xs = domain.shard(x, dims=dims, sizes=sizes)
    with domain.count_traffic() as forward:
        y = conv(xs)
    total = y.sum()  # its reduction sends 8 bytes to each peer: not a halo
    with domain.count_traffic() as backward:
        total.backward()
    # the minimum: input elements in other blocks that this rank's outputs read (faces, edges, corners)
    layout = [split_sizes(n, 2, s) for n, s in zip(shape, sizes or (None,) * len(shape))]
    ranges = [[range(o, o + n) for o, n in zip(offsets_of(lay), lay)] for lay in layout]
    coords = [dm.axis_rank(f"domain_{g}") for g in range(len(shape))]
    mine = set(itertools.product(*(r[c] for r, c in zip(ranges, coords))))
    footprint = {tuple(p + s for p, s in zip(point, step)) for point in mine
                 for step in itertools.product((-1, 0, 1), repeat=len(shape))}
    footprint = {p for p in footprint if all(0 <= q < n for q, n in zip(p, shape))}
    received = len(footprint - mine) * channels * 8
    return forward.bytes_sent, backward.bytes_sent, received, forward.rounds, forward.messages, backward.rounds


def test_halo_bytes_on_blocks_are_the_geometric_minimum(ranks):
    """Every rank must receive at least its footprint outside its block, so equal totals mean each rank receives
    exactly its minimum, and the backward returns the same rows."""
    for shape, sizes in (((10, 12), None), ((11, 9), ((4, 7), (6, 3))), ((5, 6, 7), ((3, 2), (1, 5), (4, 3)))):
        results = ranks.run(2 ** len(shape), _halo_body, shape, sizes, 3)
        sent_forward = sum(r[0] for r in results)
        assert sent_forward == sum(r[2] for r in results), results  # everything received was sent once
        assert sent_forward == sum(r[1] for r in results), results  # backward returns the same rows
        # one round each way, every neighbour (faces, edges, corners) sent a message of its own
        assert all(r[3:] == (1, 2 ** len(shape) - 1, 1) for r in results), results


def _refusals_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    x = torch.randn(1, 2, 8, 8)
    messages = []
    for attempt in (lambda: torch.histc(domain.shard(x, dims=(2, 3))),
                    lambda: domain.shard(x, dims=(2,)),
                    lambda: torch.nn.functional.unfold(domain.shard(x, dims=(2, 3)), 2),
                    lambda: domain.shard(x, dims=(2, 3)).sum(2),
                    lambda: domain.redistribute(domain.shard(x, dim=2), dims=(3, 1)),
                    lambda: domain.redistribute(domain.shard(x, dims=(2, 3)), dim=1)):
        try:
            attempt()
            messages.append("no error")
        except (NotImplementedError, ValueError) as err:
            messages.append(str(err))
    return messages


def test_ops_without_a_block_rule_raise_naming_the_op_on_every_rank(ranks):
    for messages in ranks.run(4, _refusals_body):
        assert "torch.histc has no rule for block layouts" in messages[0]
        assert "dims=(2,) names 1 sharded dims but the domain grid (2, 2) has 2" in messages[1]
        assert "unfold has no rule for block layouts" in messages[2]
        assert "covers only some of the block-sharded dims" in messages[3]
        assert "dims=(3, 1) must be 2 dims (the grid (2, 2)) including the slab dim 2" in messages[4]
        assert "dim=1 must be one of the block dims (2, 3)" in messages[5]


class _UNet3d(torch.nn.Module):
    """Conv3d, GroupNorm, max pooling, transposed conv and trilinear upsampling, reflect padding, a skip."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.enc = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU())
        self.pool = nn.MaxPool3d(2)
        self.mid = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="trilinear")
        self.up_t = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.dec = nn.Conv3d(8, 1, 3, padding=1)

    def forward(self, x):
        e = self.enc(x)
        m = self.mid(self.pool(e))
        return self.dec(torch.cat([e, self.up(m) + self.up_t(m)], dim=1))


def _unet_body(grid, net, shape, dims, sizes, steps):
    """A U-Net trained with Adam for a few steps on a domain grid vs one process: loss, output, all parameters."""
    from domain_models import TinyUNet

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    ref = (TinyUNet() if net == "2d" else _UNet3d()).double()
    mod = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-3), torch.optim.Adam(mod.parameters(), lr=1e-3)
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 2, *shape, dtype=torch.float64, generator=g)
        y = ref(x)
        loss_ref = (y * y).mean()
        loss_ref.backward()
        ys = mod(domain.shard(x, dims=dims, sizes=sizes))
        loss = (ys * ys).mean()
        loss.backward()
        worst = max(worst, abs(float(loss) - float(loss_ref)) / abs(float(loss_ref)),
                    max_err(ys.full_tensor().to_local(), y))
        sum_grads_over_domain(mod.parameters())
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    return max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))


@pytest.mark.parametrize(("grid", "sizes"), [((2, 2), ((6, 8), (4, 6))), ((2, 3), ((8, 6), (2, 4, 4))),
                                             ((3, 2), ((4, 0, 10), None))], ids=str)
def test_2d_unet_on_blocks_trains_like_one_process(ranks, grid, sizes):
    # TinyUNet: strided, dilated circular, transposed convs, GroupNorm, max pooling, bilinear upsampling, a skip
    results = ranks.run(grid[0] * grid[1], _unet_body, grid, "2d", (14, 10), (2, 3), sizes, 3)
    assert max(results) < TOL, results


def test_3d_unet_on_2x2x2_blocks_trains_like_one_process(ranks):
    results = ranks.run(8, _unet_body, (2, 2, 2), "3d", (8, 6, 10), (2, 3, 4), ((4, 4), (2, 4), (6, 4)), 2)
    assert max(results) < TOL, results


def _unet_steps(shape, path_in, path_out, first_step, steps):
    """FSDP TinyUNet on mesh ``shape`` (blocks when the domain is a grid): load ``path_in`` (if any), train, save."""
    from domain_models import H, W, TinyUNet

    from mesh3d import DistributedManager, Plan, checkpoint, domain, parallelize

    DistributedManager.initialize(*shape)
    torch.manual_seed(0)
    model = parallelize(TinyUNet().double(), Plan(batch="fsdp"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if path_in:
        checkpoint.load(path_in, model, opt)
    where = {"dims": (2, 3), "sizes": ((6, 8), (3, 7))} if isinstance(shape[1], tuple) else {"dim": 2, "sizes": (5, 1, 6, 2)}
    for step in range(first_step, first_step + steps):
        x = torch.randn(2, 2, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        ys = model(domain.shard(x, **where))
        (ys * ys).mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path_out, model, opt, step=first_step + steps)


def test_a_checkpoint_moves_between_grids_and_one_process(ranks, tmp_path):
    """2 steps on a 2x2 grid -> save -> 1 step on 4 slabs -> save -> 1 step in one process == 4 steps in one process."""
    from domain_models import H, W, TinyUNet

    from mesh3d import checkpoint

    ranks.run(4, _unet_steps, (1, (2, 2), 1), None, str(tmp_path / "a"), 0, 2)
    ranks.run(4, _unet_steps, (1, 4, 1), str(tmp_path / "a"), str(tmp_path / "b"), 2, 1)
    torch.manual_seed(0)
    ref, resumed = TinyUNet().double(), TinyUNet().double()
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(resumed.parameters(), lr=1e-2)
    assert checkpoint.load(str(tmp_path / "b"), resumed, opt).step == 3
    for step in range(4):
        x = torch.randn(2, 2, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for model, o in ((ref, opt_ref), (resumed, opt)) if step == 3 else ((ref, opt_ref),):
            (model(x) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    assert max(max_err(p, q) for p, q in zip(ref.parameters(), resumed.parameters())) < 1e-9


def _classifier_body(grid, shape, sizes):
    """Adaptive pooling on blocks (global, to uneven windows, avg and max) and a classifier head after it."""
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=grid)
    nn = torch.nn
    makers = [lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU(),
                                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)),
              lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.AdaptiveMaxPool2d((3, 2))),
              lambda: nn.AdaptiveAvgPool2d((4, 3)),
              # LayerNorm over (C, H, W): statistics over the whole grid; over W only: over one grid line
              lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.LayerNorm([3, *shape]), nn.LayerNorm(shape[-1])),
              lambda: nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(2, 2))]
    worst = 0.0
    for i, make in enumerate(makers):
        torch.manual_seed(i)
        worst = max(worst, _blocks_vs_one_process(make().double(), (2, 2, *shape), (2, 3), sizes))
    return worst


def _blocks_vs_one_process(ref: torch.nn.Module, shape, dims, sizes) -> float:
    """``ref`` in one process vs a copy on blocks: output, input and parameter gradients (domain-summed)."""
    from mesh3d import domain

    mod = copy.deepcopy(ref)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y = ref(x)
    cot = torch.randn_like(y)
    (y * cot).sum().backward()
    xi = x.detach().requires_grad_(True)
    whole = mod(domain.shard(xi, dims=dims, sizes=sizes)).full_tensor()
    (whole * cot).sum().backward()
    return max(max_err(whole.to_local(), y), max_err(domain_sum(xi.grad), x.grad),
               max((max_err(p.grad, g) for p, g in zip(ref.parameters(), domain_sums([q.grad for q in mod.parameters()]))),
                   default=0.0))


@pytest.mark.parametrize(("grid", "sizes"), [((2, 2), ((5, 6), (4, 3))), ((2, 3), ((11, 0), (2, 2, 3)))], ids=str)
def test_adaptive_pooling_and_a_classifier_head_on_blocks(ranks, grid, sizes):
    results = ranks.run(grid[0] * grid[1], _classifier_body, grid, (11, 7), sizes)
    assert max(results) < TOL, results


class _SpectralLayer(torch.nn.Module):
    """An FFT layer: rfftn over the spatial dims, a pointwise filter in frequency, irfftn back (s= read from the
    input's shape), fftshift of a full fft, a 1x1 conv and a residual."""

    def __init__(self, nd: int) -> None:
        super().__init__()
        self.nd = nd
        self.mix = getattr(torch.nn, f"Conv{nd}d")(2, 2, 1)

    def forward(self, x):
        dims = tuple(range(-self.nd, 0))
        z = torch.fft.rfftn(x, dim=dims, norm="ortho")
        z = z * torch.sigmoid(z.abs())
        y = torch.fft.irfftn(z, s=x.shape[-self.nd:], dim=dims, norm="ortho")
        shifted = torch.fft.fftshift(torch.fft.fftn(x, dim=dims), dim=dims).abs()
        return self.mix(y) + x + 0.1 * shifted


def _spectral_body(grid, shape, dims, sizes):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    return _blocks_vs_one_process(_SpectralLayer(len(shape)).double(), (2, 2, *shape), dims, sizes)


@pytest.mark.parametrize(("grid", "shape", "dims", "sizes"), [
    ((2, 2), (8, 6), (2, 3), None), ((2, 3), (9, 7), (2, 3), ((6, 3), (4, 0, 3))),
    ((2, 2, 2), (6, 5, 4), (2, 3, 4), ((2, 4), (3, 2), (1, 3)))], ids=str)
def test_an_fft_layer_on_blocks_equals_one_process(ranks, grid, shape, dims, sizes):
    """Pencil transposes: each grid line swaps its block dim for a slice of the channel or batch dim."""
    results = ranks.run(math.prod(grid), _spectral_body, grid, shape, dims, sizes)
    assert max(results) < TOL, results


def _relayout_body(grid, slab_sizes, block_sizes, back_dim):
    """Slabs -> blocks -> a conv -> slabs along ``back_dim``: the values, and the gradient through both moves."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64)
    x = torch.randn(2, 2, 9, 7, dtype=torch.float64, requires_grad=True)
    y = conv(x)
    cot = torch.randn_like(y)
    (y * cot).sum().backward()
    xi = x.detach().requires_grad_(True)
    bs = domain.redistribute(domain.shard(xi, dim=2, sizes=slab_sizes), dims=(2, 3), sizes=block_sizes)
    # blocks -> blocks: new sizes on the same dims, then over other dims (channels and width) and back
    rebalanced = domain.redistribute(bs, dims=(2, 3))
    other = domain.redistribute(rebalanced, dims=(1, 3))
    bs2 = domain.redistribute(other, dims=(2, 3), sizes=block_sizes)
    moved_exactly = max(max_err(t.full_tensor().to_local(), x) for t in (rebalanced, other, bs2))
    back = domain.redistribute(conv(bs2), dim=back_dim)
    whole = back.full_tensor()
    (whole * cot).sum().backward()
    return (max(max_err(bs.full_tensor().to_local(), x), moved_exactly), max_err(whole.to_local(), y),
            max_err(domain_sum(xi.grad), x.grad), back.sharded_dim, (tuple(bs.spec.sizes), other.spec.dims))


@pytest.mark.parametrize(("grid", "slab_sizes", "block_sizes", "back_dim"), [
    ((2, 2), (3, 0, 4, 2), ((5, 4), (3, 4)), 2), ((2, 2), None, None, 3), ((3, 2), (9, 0, 0, 0, 0, 0), None, 2)],
    ids=str)
def test_slabs_move_to_blocks_to_other_blocks_and_back(ranks, grid, slab_sizes, block_sizes, back_dim):
    for layout_err, out_err, grad_err, dim, sizes in ranks.run(math.prod(grid), _relayout_body, grid, slab_sizes,
                                                                block_sizes, back_dim):
        assert layout_err == 0.0 and out_err < TOL and grad_err < TOL and dim == back_dim
        assert block_sizes is None or sizes[0] == block_sizes
        assert sizes[1] == (1, 3)
