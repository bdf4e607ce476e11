"""Finite differences (``mesh3d.domain.ops.finite_differences``) against one process, fp64: ``torch.diff`` (orders 1
and 2, prepend/append, bool), ``torch.gradient`` (edge orders 1 and 2, spacings per dim) and ``torch.trapezoid``
(``dx`` and sample points ``x``), along the sharded dim and others, on slabs of 2 and 3 uneven ranks (an empty shard,
a shard of one row) and on a 2x2 grid of uneven blocks: values and the input's gradient; then a heat-equation
residual trained for three SGD steps, as a PINN computes it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from domain_cases import assert_equal_or_refused, case_error, step_both

TOL = 1e-10
H, W = 9, 7
D64 = torch.float64


def _cases(points: torch.Tensor) -> dict:
    return {
        "diff_sharded": lambda u: torch.diff(u, dim=2),
        "diff_order_2": lambda u: u.diff(n=2, dim=2) * 3,
        "diff_other_dim": lambda u: torch.diff(u, dim=-1),
        "diff_prepend_append": lambda u: torch.diff(u, dim=2, prepend=torch.zeros(2, 3, 1, W, dtype=D64),
                                                    append=torch.ones(2, 3, 2, W, dtype=D64)),
        "diff_bool": lambda u: torch.diff(u > 0, dim=2).to(D64) * u[:, :, 1:],
        "gradient_all_dims": lambda u: sum(g.sum() for g in torch.gradient(u)),
        "gradient_edge_2": lambda u: torch.gradient(u, spacing=(0.5, 0.25), dim=(2, 3), edge_order=2)[0]
        * torch.gradient(u, spacing=(0.5, 0.25), dim=(2, 3), edge_order=2)[1],
        "gradient_one_dim": lambda u: torch.gradient(u, spacing=2.0, dim=2)[0],
        "trapezoid_dx": lambda u: torch.trapezoid(u, dx=0.3, dim=2),
        "trapezoid_x": lambda u: torch.trapezoid(u, points, dim=2),
        "trapezoid_other_dim": lambda u: torch.trapezoid(u, dim=3).sum(),
        "trapz_x": lambda u: torch.trapz(u, points, dim=2),
    }


def _body(layout: dict) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    g = torch.Generator().manual_seed(4)
    u0 = torch.randn(2, 3, H, W, dtype=D64, generator=g)
    points = torch.cumsum(torch.rand(H, dtype=D64, generator=g) + 0.1, 0)

    def shard(t: torch.Tensor) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(2, 3), sizes=layout["sizes"])
        return domain.shard(t, dim=2, sizes=layout["sizes"])

    errors = {name: case_error(lambda u, sharded, fn=fn: fn(shard(u) if sharded else u), u0, i)
              for i, (name, fn) in enumerate(_cases(points).items())}
    DistributedManager.shutdown()
    return errors


_PART = "torch.sum over dims [2] covers only some of the block-sharded dims"
_SELECT = "torch.Tensor.select has no rule for block layouts"
LAYOUTS = {
    "slabs 2 (8, 1)": {"world": 2, "grid": 2, "sizes": (8, 1)},
    "slabs 3 (4, 0, 5)": {"world": 3, "grid": 3, "sizes": (4, 0, 5)},
    "blocks 2x2 (5, 4) x (3, 4)": {"world": 4, "grid": (2, 2), "dims": True, "sizes": ((5, 4), (3, 4))},
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_finite_differences_equal_one_process(ranks, layout):
    spec = LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _body, spec):
        # Blocks reduce over all their block dims or none: a quadrature along one of them is refused by name.
        assert_equal_or_refused(errors, {"trapezoid_dx": _SELECT, "trapezoid_other_dim": _SELECT, "trapezoid_x": _PART,
                                         "trapz_x": _PART} if "dims" in spec else {}, TOL)


def _heat_body(layout: dict, steps: int) -> float:
    """A network u(x) on a field, trained on the heat equation's residual u_t - k lap(u) by finite differences (the
    Laplacian from torch.gradient twice, the time derivative from torch.diff) plus its trapezoid integral; the largest
    difference from one process (losses, parameters after each step)."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, 8, 3, padding=1, dtype=D64), torch.nn.Tanh(),
                              torch.nn.Conv2d(8, 2, 3, padding=1, dtype=D64))
    mod = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(mod.parameters(), lr=0.05)

    def loss_of(field):
        u = ref_or(field)
        u_t = torch.diff(u, dim=1)                                   # two time levels in the channels
        u_yy = torch.gradient(torch.gradient(u[:, :1], spacing=0.1, dim=2)[0], spacing=0.1, dim=2)[0]
        u_xx = torch.gradient(torch.gradient(u[:, :1], spacing=0.2, dim=3, edge_order=2)[0], spacing=0.2, dim=3)[0]
        residual = (u_t - 0.01 * (u_yy + u_xx)) ** 2
        if "dims" in layout:  # blocks: no quadrature along one block dim (see above)
            return residual.mean()
        return residual.mean() + torch.trapezoid(torch.trapezoid(u ** 2, dx=0.1, dim=2), dx=0.2, dim=2).mean()

    worst = 0.0
    for step in range(steps):
        field = torch.randn(2, 2, H, W, dtype=D64, generator=torch.Generator().manual_seed(step))
        ref_or = ref
        loss_ref = loss_of(field)
        loss_ref.backward()
        ref_or = mod
        xs = domain.shard(field, dims=(2, 3), sizes=layout["sizes"]) if "dims" in layout else \
            domain.shard(field, dim=2, sizes=layout["sizes"])
        loss = loss_of(xs)
        loss.backward()
        worst = max(worst, step_both(ref, mod, opt_ref, opt, loss_ref, loss))
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_a_heat_equation_residual_trains_equal_to_one_process(ranks, layout):
    spec = LAYOUTS[layout]
    assert max(ranks.run(spec["world"], _heat_body, spec, 3)) < TOL
