"""``F.grid_sample`` of a field sharded along a spatial dim, the grid sharded like the output, against one process
(fp64; ``mesh3d.domain.ops.grid_sample``): bilinear, nearest and bicubic, zero, border and reflection padding, both
``align_corners``, on grids that reach other ranks' rows and beyond the field (reflected up to twice), on identity
grids (every point on an exact row: the gradient's side must be torch's) and a shifted one; the field sharded along
its height or its width, on slabs of 2 and 3 uneven ranks (an empty shard); volumes (5-D, trilinear) sharded along
their depth or width. Values, the field's and the grid's gradients. A whole field with a sharded grid, and both
sharded by samples, run locally. What the rule does not take is refused by name. Then a semi-Lagrangian advection
step, its displacement predicted by a conv, trains three SGD steps equal to one process.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from domain_cases import domain_sum, max_err, trained_alike

TOL = 1e-10
H, W, HO, WO = 9, 7, 6, 5
D64 = torch.float64


def _grids() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    eye = torch.tensor([[[1.0, 0, 0], [0, 1.0, 0]]] * 2, dtype=D64)
    return {
        "beyond": torch.rand(2, HO, WO, 2, dtype=D64, generator=g) * 2.6 - 1.3,  # a fifth of the points outside
        "far": torch.rand(2, HO, WO, 2, dtype=D64, generator=g) * 6 - 3,  # reflected up to twice
        "identity": F.affine_grid(eye, (2, 3, H, W), align_corners=False),
        "identity_ac": F.affine_grid(eye, (2, 3, H, W), align_corners=True),
        "shifted": F.affine_grid(eye, (2, 3, H, W), align_corners=False) + torch.tensor([0.1, 0.37], dtype=D64),
    }


def _uneven(n: int, world: int) -> tuple[int, ...]:
    return tuple(n // world + (1 if r >= world - n % world else 0) for r in range(world))


def _errors(x0: torch.Tensor, grids: dict[str, torch.Tensor], world: int, field: tuple[int, tuple[int, ...]],
            grid_dim: int, modes: tuple[str, ...] = ("bilinear", "nearest")) -> dict:
    """Every grid x mode x padding x align_corners: the largest error of the value, the field's and the grid's grads,
    the field sharded as ``field`` (dim, sizes) and the grid unevenly along ``grid_dim``."""
    from mesh3d import domain

    errors = {}
    for gname, g0 in grids.items():
        for mode, padding, align in itertools.product(modes, ("zeros", "border", "reflection"), (False, True)):
            x, grid = x0.clone().requires_grad_(), g0.clone().requires_grad_()
            want = F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=align)
            cot = torch.randn(want.shape, dtype=D64, generator=torch.Generator().manual_seed(1))
            (want * cot).sum().backward()
            want_x, want_grid = x.grad, grid.grad
            x.grad = grid.grad = None
            xs = domain.shard(x, dim=field[0], sizes=field[1])
            gs = domain.shard(grid, dim=grid_dim, sizes=_uneven(grid.shape[grid_dim], world))
            got = F.grid_sample(xs, gs, mode=mode, padding_mode=padding, align_corners=align)
            whole = got.full_tensor().to_local()
            (whole * cot).sum().backward()
            errors[(gname, mode, padding, align)] = max(
                max_err(whole, want), max_err(domain_sum(x.grad), want_x), max_err(domain_sum(grid.grad), want_grid))
    return errors


def _body(world: int, field_sizes: tuple[int, ...], field_dim: int) -> dict:
    """A 4-D field: ``_errors`` with the grid sharded along its output height."""
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=world)
    x0 = torch.randn(2, 3, H, W, dtype=D64, generator=torch.Generator().manual_seed(4))
    errors = _errors(x0, _grids(), world, (field_dim, field_sizes), 1, ("bilinear", "nearest", "bicubic"))
    DistributedManager.shutdown()
    return errors


CASES = {  # world, the field's sizes, the field's sharded dim
    "2 ranks, height (5, 4)": (2, (5, 4), 2),
    "3 ranks, height (4, 0, 5)": (3, (4, 0, 5), 2),
    "3 ranks, width (3, 4, 0)": (3, (3, 4, 0), 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grid_sample_equals_one_process_values_and_both_gradients(ranks, case):
    for errors in ranks.run(CASES[case][0], _body, *CASES[case]):
        assert len(errors) == 90 and max(errors.values()) < TOL, {k: v for k, v in errors.items() if not v < TOL}


DV, HV, WV, DO = 7, 4, 3, 5  # a volume (N, C, D, H, W) and its grid's output depth


def _volume_grids() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    eye = torch.eye(3, 4, dtype=D64).expand(2, 3, 4)
    return {
        "beyond": torch.rand(2, DO, 4, 3, 3, dtype=D64, generator=g) * 2.6 - 1.3,
        "far": torch.rand(2, DO, 4, 3, 3, dtype=D64, generator=g) * 6 - 3,
        "identity": F.affine_grid(eye, (2, 2, DV, HV, WV), align_corners=False),
        "identity_ac": F.affine_grid(eye, (2, 2, DV, HV, WV), align_corners=True),
        "shifted": F.affine_grid(eye, (2, 2, DV, HV, WV), align_corners=False) + torch.tensor([0.1, -0.2, 0.37], dtype=D64),
    }


def _volume_body(world: int, field_sizes: tuple[int, ...], field_dim: int, grid_dim: int) -> dict:
    """Trilinear and nearest sampling of a volume sharded along ``field_dim``, the grid along ``grid_dim``."""
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=world)
    x0 = torch.randn(2, 2, DV, HV, WV, dtype=D64, generator=torch.Generator().manual_seed(5))
    errors = _errors(x0, _volume_grids(), world, (field_dim, field_sizes), grid_dim)
    DistributedManager.shutdown()
    return errors


VOLUMES = {  # world, the volume's sizes, its sharded dim, the grid's sharded dim
    "2 ranks, depth (4, 3), grid by output depth": (2, (4, 3), 2, 1),
    "3 ranks, depth (3, 0, 4), grid by output height": (3, (3, 0, 4), 2, 2),
    "3 ranks, width (1, 2, 0), grid by output depth": (3, (1, 2, 0), 4, 1),
}


@pytest.mark.parametrize("case", list(VOLUMES))
def test_grid_sample_of_a_volume_equals_one_process_values_and_both_gradients(ranks, case):
    """5-D: trilinear taps in torch's order, the 3-D CPU kernel's own unnormalization (float32 tells it apart from the
    2-D kernel's fused multiply-add), a volume sharded along its depth or width."""
    for errors in ranks.run(VOLUMES[case][0], _volume_body, *VOLUMES[case]):
        assert len(errors) == 60 and max(errors.values()) < TOL, {k: v for k, v in errors.items() if not v < TOL}


def _float32_identity_body(depths: tuple[int, ...]) -> list[float]:
    """Identity grids of volumes in float32 (every point on an exact plane), sharded along the depth over 2 ranks: the
    largest relative error of the grid's gradient per depth, against one process."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=2)
    errors = []
    for depth in depths:
        x = torch.randn(1, 2, depth, 3, 2, generator=torch.Generator().manual_seed(depth))
        grid = F.affine_grid(torch.eye(3, 4)[None], (1, 2, depth, 3, 2), align_corners=False)
        cot = torch.randn(1, 2, depth, 3, 2, generator=torch.Generator().manual_seed(7))
        g1, g2 = grid.clone().requires_grad_(), grid.clone().requires_grad_()
        (F.grid_sample(x, g1, align_corners=False) * cot).sum().backward()
        sizes = _uneven(depth, 2)
        got = F.grid_sample(domain.shard(x, dim=2, sizes=sizes), domain.shard(g2, dim=1, sizes=sizes), align_corners=False)
        (got.full_tensor().to_local() * cot).sum().backward()
        errors.append(float(((domain_sum(g2.grad) - g1.grad).abs().max() / g1.grad.abs().max())))
    DistributedManager.shutdown()
    return errors


def test_a_float32_identity_grid_of_a_volume_takes_torch_s_gradient_side(ranks):
    """Depths where the 2-D kernel's fused multiply-add would floor some planes the other way (found by scanning 2 to
    60): the 3-D kernel's plain formula gives torch's gradient at each (float32 rounding apart)."""
    for errors in ranks.run(2, _float32_identity_body, (11, 18, 25, 38, 57)):
        assert max(errors) < 1e-5, errors


def _local_and_refused_body() -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=2)
    x = torch.randn(2, 3, H, W, dtype=D64, generator=torch.Generator().manual_seed(4))
    grid = _grids()["beyond"]
    out = {}
    whole_field = F.grid_sample(x, domain.shard(grid, dim=2, sizes=(2, 3)), align_corners=True)  # sharded along Wo
    out["whole field"] = max_err(whole_field.full_tensor().to_local(), F.grid_sample(x, grid, align_corners=True))
    by_sample = F.grid_sample(domain.shard(x, dim=0, sizes=(1, 1)), domain.shard(grid, dim=0, sizes=(1, 1)))
    out["by samples"] = max_err(by_sample.full_tensor().to_local(), F.grid_sample(x, grid))
    xs, gs = domain.shard(x, dim=2, sizes=(5, 4)), domain.shard(grid, dim=1, sizes=(3, 3))
    vs = domain.shard(torch.randn(2, 3, 4, H, W, dtype=D64), dim=3, sizes=(5, 4))
    vgrid = domain.shard(torch.rand(2, 3, 4, 5, 3, dtype=D64) * 2 - 1, dim=1, sizes=(1, 2))
    for name, call in {"bicubic volume": lambda: F.grid_sample(vs, vgrid, mode="bicubic"),
                       "whole grid": lambda: F.grid_sample(xs, grid),
                       "grid by coordinates": lambda: F.grid_sample(xs, domain.shard(grid, dim=3, sizes=(1, 1))),
                       "channels": lambda: F.grid_sample(domain.shard(x, dim=1, sizes=(1, 2)), gs)}.items():
        try:
            call()
            out[name] = "ran"
        except NotImplementedError as err:
            out[name] = str(err)
    DistributedManager.shutdown()
    return out


def test_a_whole_field_and_samples_run_locally_and_what_has_no_rule_is_refused_by_name(ranks):
    for out in ranks.run(2, _local_and_refused_body):
        assert out["whole field"] < TOL and out["by samples"] < TOL, out
        assert "mode='bicubic'" in out["bicubic volume"] and "bicubic on 4-D ones" in out["bicubic volume"], out
        assert "domain.shard(grid, dim=1" in out["whole grid"], out
        assert "along its coordinates" in out["grid by coordinates"] and "shard a spatial dim" in out["channels"], out
        assert all(v.startswith("torch.nn.functional.grid_sample") for k, v in out.items() if isinstance(v, str)), out


class Advection(torch.nn.Module):
    """One semi-Lagrangian step: a conv predicts each point's displacement, the field is sampled at the departure
    points (bilinear, border padding), then mixed by a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.velocity = torch.nn.Conv2d(2, 2, 3, padding=1, dtype=D64)
        self.mix = torch.nn.Conv2d(2, 2, 1, dtype=D64)

    def forward(self, field, base):
        departure = base - 0.3 * torch.tanh(self.velocity(field)).permute(0, 2, 3, 1)
        return self.mix(F.grid_sample(field, departure, padding_mode="border", align_corners=False))


def _train_body(world: int, sizes: tuple[int, ...], steps: int) -> float:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    base = F.affine_grid(torch.tensor([[[1.0, 0, 0], [0, 1.0, 0]]] * 2, dtype=D64), (2, 2, H, W), align_corners=False)

    def loss(model, step, sharded):
        field = torch.randn(2, 2, H, W, dtype=D64, generator=torch.Generator().manual_seed(step))
        target = torch.roll(field, 1, 2)
        if sharded:
            field, target, grid = (domain.shard(t, dim=d, sizes=sizes) for t, d in ((field, 2), (target, 2), (base, 1)))
            return (model(field, grid) - target).square().mean()
        return (model(field, base) - target).square().mean()

    worst = trained_alike(Advection(), loss, steps, 0.1)
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("world, sizes", [(2, (6, 3)), (3, (4, 0, 5))])
def test_a_semi_lagrangian_step_trains_equal_to_one_process(ranks, world, sizes):
    assert max(ranks.run(world, _train_body, world, sizes, 3)) < TOL
