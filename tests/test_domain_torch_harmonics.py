"""torch-harmonics on latitude slabs and lat x lon blocks (issue 67), unchanged, against one process: its ``RealSHT``
and ``InverseRealSHT`` (equiangular and Legendre-Gauss grids) exact in fp64, values and the input's gradient, at 2 and
3 uneven ranks (an empty shard) and on 2x2 blocks (an empty block; the coefficients on pencils there); its SFNO
(``torch_harmonics.examples.models.sfno``) trains three SGD steps equal to one process under its own precision (its
spectral convolutions compute in fp32 whatever the model's dtype, so the tolerance is fp32's); a DISCO convolution
beside them (tests/test_domain_disco.py covers its paths). The rules mesh3d ships for the library load the first
time one of its functions or kernels meets a domain tensor (``registry.SHIPPED_RULES``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

from domain_cases import assert_equal_or_refused, case_error, trained_alike

NLAT, NLON = 16, 32
D64 = torch.float64
LAYOUTS = {"2 ranks (9, 7)": (2, (9, 7)), "3 ranks (6, 0, 10)": (3, (6, 0, 10)),
           # lat x lon blocks: the Legendre sums move the coefficients to pencils (l split over the latitude line)
           "2x2 blocks (9, 7) x (20, 12)": ((2, 2), ((9, 7), (20, 12))),
           "2x2 blocks (16, 0) x (5, 27)": ((2, 2), ((16, 0), (5, 27)))}


def _shard(x: torch.Tensor, world, sizes):
    from mesh3d import domain

    return domain.shard(x, dims=(2, 3), sizes=sizes) if isinstance(world, tuple) else domain.shard(x, dim=2, sizes=sizes)


def _ranks(world) -> int:
    return 4 if isinstance(world, tuple) else world


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch-harmonics' note that its default truncation changed in 0.9.0, said at every SHT it builds, silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Default SHT truncation")
        yield


def _transforms_body(world, sizes: tuple) -> dict:
    import torch_harmonics as th

    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=world)
    x0 = torch.randn(2, 3, NLAT, NLON, dtype=D64, generator=torch.Generator().manual_seed(4))
    errors = {}
    for i, grid in enumerate(("equiangular", "legendre-gauss")):
        with _quiet():
            sht, isht = th.RealSHT(NLAT, NLON, grid=grid).double(), th.InverseRealSHT(NLAT, NLON, grid=grid).double()

        def forward_then_back(x, sharded, sht=sht, isht=isht):  # the field filtered by a spectral factor
            coeffs = sht(_shard(x, world, sizes) if sharded else x)
            return isht(coeffs * torch.linspace(1.0, 0.2, coeffs.shape[-1], dtype=D64))

        errors[f"sht+isht {grid}"] = case_error(forward_then_back, x0, i)
        errors[f"sht {grid}"] = case_error(
            lambda x, sharded, sht=sht: torch.view_as_real(sht(_shard(x, world, sizes) if sharded else x)),
            x0, 10 + i)
    disco = th.DiscreteContinuousConvS2(3, 4, (NLAT, NLON), (NLAT, NLON), kernel_shape=3).double()
    errors["disco"] = case_error(lambda x, sharded: disco(_shard(x, world, sizes) if sharded else x), x0, 20)
    DistributedManager.shutdown()
    return errors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_spherical_harmonic_transforms_equal_one_process(ranks, layout):
    world, sizes = LAYOUTS[layout]
    for errors in ranks.run(_ranks(world), _transforms_body, world, sizes):
        assert_equal_or_refused(errors, {}, 1e-10)


def _sfno_body(world, sizes: tuple, steps: int) -> float:
    from torch_harmonics.examples.models.sfno import SphericalFourierNeuralOperator

    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    with _quiet():
        net = SphericalFourierNeuralOperator(img_size=(NLAT, NLON), in_chans=3, out_chans=3, embed_dim=8, num_layers=2,
                                             scale_factor=2, normalization_layer="instance_norm").double()

    def loss(model, step, sharded):
        x = torch.randn(2, 3, NLAT, NLON, dtype=D64, generator=torch.Generator().manual_seed(step))
        x = _shard(x, world, sizes) if sharded else x
        return (model(x) - x.roll(1, -1)).square().mean()

    worst = trained_alike(net, loss, steps, 0.05)
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_harmonics_sfno_trains_equal_to_one_process_under_its_fp32_spectral_convolutions(ranks, layout):
    world, sizes = LAYOUTS[layout]
    assert max(ranks.run(_ranks(world), _sfno_body, world, sizes, 3)) < 1e-5
