"""torch-harmonics' DISCO convolutions and neighbourhood attention on latitude slabs (issue 67), unchanged, against one
process at 2 and 3 uneven ranks (an empty shard): values and the input's gradient of every kernel path the modules
take on CPU (the plain contraction, the save-x and fused variants, the transpose), on equiangular and Legendre-Gauss
grids, same-size, downsampling and upsampling; the same on 2x2 lat x lon blocks (an empty block among them); a small
DISCO network trained three SGD steps (fp64, weights' gradients summed over the domain); and the refusals by name:
longitudes sharded as slabs, the pure-PyTorch path, upsampling attention.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from domain_cases import assert_equal_or_refused, case_error, trained_alike

NLAT, NLON = 16, 32
D64 = torch.float64
#: (world, sizes of the 16 latitudes, sizes of 8 latitudes: a downsampled grid's input)
LAYOUTS = {"2 ranks (9, 7)": (2, (9, 7), (5, 3)), "3 ranks (6, 0, 10)": (3, (6, 0, 10), (3, 0, 5))}


def _disco_cases_body(world: int | tuple[int, int], sizes: tuple, coarse: tuple) -> dict:
    """Every case on slabs of ``world`` ranks, or on blocks of a ``world`` grid (``sizes``: per block dim)."""
    import torch_harmonics as th

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=world)
    blocks = isinstance(world, tuple)

    def shard(x, dim, sizes):
        return domain.shard(x, dims=(2, 3), sizes=sizes) if blocks else domain.shard(x, dim=dim, sizes=sizes)

    g = torch.Generator().manual_seed(4)
    x0, x8 = torch.randn(2, 6, NLAT, NLON, dtype=D64, generator=g), torch.randn(2, 6, 8, 16, dtype=D64, generator=g)
    fine, small = (NLAT, NLON), (8, 16)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cutoff it chose for each layer
        convs = {
            "same": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=3),
            "downsampling": th.DiscreteContinuousConvS2(6, 4, fine, small, kernel_shape=3),
            "save-x (fewer outputs than inputs)": th.DiscreteContinuousConvS2(6, 2, fine, fine, kernel_shape=3),
            "fused": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=3, fused=True),
            "morlet (3, 4)": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=(3, 4), basis_type="morlet"),
            "legendre-gauss": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=3, grid_in="legendre-gauss",
                                                          grid_out="legendre-gauss"),
            "groups": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=3, groups=2),
            "transpose": th.DiscreteContinuousConvTransposeS2(6, 4, fine, fine, kernel_shape=3),
            "longitudes sharded": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=3),
            "pure-PyTorch path": th.DiscreteContinuousConvS2(6, 4, fine, fine, kernel_shape=3, optimized_kernel=False),
        }
        upsampling = th.DiscreteContinuousConvTransposeS2(6, 4, small, fine, kernel_shape=3).double()
    assert convs["save-x (fewer outputs than inputs)"]._save_x_spatial_first_ok  # the path it names is the one taken
    errors = {}
    for i, (name, conv) in enumerate(convs.items()):
        conv.double()
        dim = 3 if name == "longitudes sharded" else 2
        errors[name] = case_error(
            lambda x, sharded, conv=conv, dim=dim: conv(shard(x, dim, sizes if dim == 2 else None)
                                                        if sharded else x), x0, i)
    errors["transpose upsampling"] = case_error(
        lambda x, sharded: upsampling(shard(x, 2, coarse) if sharded else x), x8, 20)
    DistributedManager.shutdown()
    return errors


#: 2x2 lat x lon blocks: (the 16 x 32 grid's sizes, the 8 x 16 grid's), an empty block among them
BLOCKS = {"2x2 (9, 7) x (20, 12)": (((9, 7), (20, 12)), ((5, 3), (10, 6))),
          "2x2 (16, 0) x (5, 27)": (((16, 0), (5, 27)), ((8, 0), (3, 13)))}


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(BLOCKS))
def test_disco_convolutions_equal_one_process_or_are_refused_by_name(ranks, layout):
    world, sizes, coarse = LAYOUTS[layout] if layout in LAYOUTS else ((2, 2), *BLOCKS[layout])
    refusals = {"pure-PyTorch path": "torch.bmm"}
    if layout in LAYOUTS:  # as slabs along longitudes: the kernel shifts them
        refusals["longitudes sharded"] = "torch.ops.disco_kernels._disco_s2_contraction_optimized (torch-harmonics' DISCO"
    for errors in ranks.run(4 if layout in BLOCKS else world, _disco_cases_body, world, sizes, coarse):
        assert_equal_or_refused(errors, refusals, 1e-12)


def _attention_cases_body(world: int | tuple[int, int], sizes: tuple, coarse: tuple) -> dict:
    import torch_harmonics as th

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=world)
    blocks = isinstance(world, tuple)
    g = torch.Generator().manual_seed(5)
    x0, q8 = torch.randn(2, 4, NLAT, NLON, generator=g), torch.randn(2, 4, 8, 16, generator=g)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        self_attention = th.NeighborhoodAttentionS2(4, (NLAT, NLON), (NLAT, NLON), num_heads=2)
        downsampling = th.NeighborhoodAttentionS2(4, (NLAT, NLON), (8, 16), num_heads=2)
        upsampling = th.NeighborhoodAttentionS2(4, (8, 16), (NLAT, NLON), num_heads=1)
    def shard(x, dim, sizes):
        return domain.shard(x, dims=(2, 3), sizes=sizes) if blocks else domain.shard(x, dim=dim, sizes=sizes)

    errors = {
        "self-attention": case_error(lambda x, s: self_attention(shard(x, dim=2, sizes=sizes) if s else x), x0, 1),
        # queries on the coarse grid, keys and values on the fine one (cross-attention between resolutions)
        "downsampling": case_error(lambda x, s: downsampling(shard(q8, dim=2, sizes=coarse) if s else q8,
                                                             shard(x, dim=2, sizes=sizes) if s else x,
                                                             shard(x, dim=2, sizes=sizes) if s else x), x0, 2),
        "upsampling": case_error(lambda x, s: upsampling(shard(x, dim=2, sizes=sizes) if s else x,
                                                         shard(q8, dim=2, sizes=coarse) if s else q8,
                                                         shard(q8, dim=2, sizes=coarse) if s else q8), x0, 3),
    }
    DistributedManager.shutdown()
    return errors


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(BLOCKS))
def test_neighbourhood_attention_equals_one_process_or_is_refused_by_name(ranks, layout):
    """float32 (the library's CPU kernels compute in it): the forward is the same sum in the same order; the keys' and
    values' gradients are summed over the ranks whose queries reach them."""
    world, sizes, coarse = LAYOUTS[layout] if layout in LAYOUTS else ((2, 2), *BLOCKS[layout])
    for errors in ranks.run(4 if layout in BLOCKS else world, _attention_cases_body, world, sizes, coarse):
        assert_equal_or_refused(errors, {"upsampling": "torch.ops.attention_kernels._neighborhood_s2_attention"},
                                2e-6)


def _disco_net_body(world: int | tuple[int, int], sizes: tuple) -> float:
    import torch_harmonics as th

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = torch.nn.Sequential(
            th.DiscreteContinuousConvS2(3, 8, (NLAT, NLON), (8, 16), kernel_shape=3), torch.nn.GELU(),
            th.DiscreteContinuousConvTransposeS2(8, 6, (8, 16), (NLAT, NLON), kernel_shape=3), torch.nn.GELU(),
            th.DiscreteContinuousConvS2(6, 2, (NLAT, NLON), (NLAT, NLON), kernel_shape=(3, 2), basis_type="morlet"),
            th.DiscreteContinuousConvS2(2, 3, (NLAT, NLON), (NLAT, NLON), kernel_shape=3, fused=True)).double()

    def loss(model, step, sharded):
        x = torch.randn(2, 3, NLAT, NLON, dtype=D64, generator=torch.Generator().manual_seed(step))
        if sharded:
            x = domain.shard(x, dims=(2, 3), sizes=sizes) if isinstance(world, tuple) else domain.shard(x, dim=2, sizes=sizes)
        return (model(x) - x.roll(1, -1)).square().mean()

    worst = trained_alike(net, loss, 3, 0.1)
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("layout", [*LAYOUTS, "2x2 (9, 7) x (20, 12)"])
def test_a_disco_network_trains_equal_to_one_process(ranks, layout):
    world, sizes = (LAYOUTS[layout][:2]) if layout in LAYOUTS else ((2, 2), BLOCKS[layout][0])
    assert max(ranks.run(4 if layout in BLOCKS else world, _disco_net_body, world, sizes)) < 1e-12


def test_a_local_pattern_is_kept_with_the_buffers_it_was_cut_from():
    """The rules' cache of local patterns: found again for the same buffers, made again after an in-place write, never
    found for other buffers (equal values or not, wherever they were allocated), dropped with its buffers."""
    import gc

    from mesh3d.domain.ops.disco import PsiCuts

    cuts = PsiCuts()
    psi = tuple(torch.arange(6) * k for k in range(5))
    assert cuts.get(psi, ("layout",), lambda: "cut") == "cut"
    assert cuts.get(psi, ("layout",), lambda: "again") == "cut"
    assert cuts.get(psi, ("other layout",), lambda: "second") == "second"
    psi[3].add_(1)  # a module's buffer written in place
    assert cuts.get(psi, ("layout",), lambda: "after the write") == "after the write"
    twin = tuple(t.clone() for t in psi)
    assert cuts.get(twin, ("layout",), lambda: "the twin's") == "the twin's"
    del twin
    gc.collect()
    assert len(cuts._cache) == 1
