"""Order statistics (``mesh3d.domain.ops.order``) against one process, fp64: sort, argsort, topk, kthvalue, median,
nanmedian, mode, quantile, cummax, cummin and logcumsumexp along the sharded dim, along another dim and over
everything, on slabs of 2 and 3 uneven ranks (an empty shard) and a 2x2 grid of uneven blocks: values and the
input's gradient. On blocks the orders that keep the shape run along either block dim and the rest over everything;
along one block dim those are refused by name."""

from __future__ import annotations

import pytest
import torch

from domain_cases import RULE_LAYOUTS, assert_equal_or_refused, case_error

TOL = 1e-10
D64 = torch.float64
H, W = 9, 6


def _cases() -> dict:
    q = torch.tensor([0.25, 0.75], dtype=D64)
    return {
        "sort_sharded": lambda u: torch.sort(u, dim=2).values,
        "sort_desc_last": lambda u: u.sort(dim=-1, descending=True)[0],
        "argsort_sharded": lambda u: torch.argsort(u, 2).to(D64) * u,
        "sort_indices_stable": lambda u: torch.sort(u.round(), dim=2, stable=True).indices.to(D64) + u,
        "topk_sharded": lambda u: torch.topk(u, 3, dim=2).values,
        "topk_channels": lambda u: u.topk(2, dim=1)[0],
        "kthvalue_sharded": lambda u: torch.kthvalue(u, 2, dim=2).values,
        "median_sharded": lambda u: torch.median(u, 2, keepdim=True).values,
        "median_all": lambda u: u.median() * u,
        "median_channels": lambda u: u.median(dim=1).values,
        "nanmedian_all": lambda u: torch.nanmedian(u),
        "mode_sharded": lambda u: torch.mode(u.round(), 2).values + u.sum(2),
        "quantile_sharded": lambda u: torch.quantile(u, 0.3, dim=2),
        "quantile_all": lambda u: torch.quantile(u, q),
        "quantile_channels": lambda u: torch.nanquantile(u, q, dim=1, keepdim=True),
        "cummax_sharded": lambda u: torch.cummax(u, 2).values,
        "cummin_last": lambda u: u.cummin(-1)[0],
        "logcumsumexp_sharded": lambda u: torch.logcumsumexp(u, 2),
    }


def _body(layout: dict) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    u0 = torch.randn(2, 3, H, W, dtype=D64, generator=torch.Generator().manual_seed(3))

    def shard(t: torch.Tensor) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(2, 3), sizes=layout["sizes"])
        return domain.shard(t, dim=2, sizes=layout["sizes"])

    errors = {name: case_error(lambda u, sharded, fn=fn: fn(shard(u) if sharded else u), u0, i)
              for i, (name, fn) in enumerate(_cases().items())}
    DistributedManager.shutdown()
    return errors


#: What blocks refuse: a selection or reduction along one block dim.
_ALONG_BLOCK_DIM = {name: f"torch.{op} along block dim 2" for name, op in (
    ("topk_sharded", "topk"), ("kthvalue_sharded", "kthvalue"), ("median_sharded", "median"),
    ("mode_sharded", "mode"), ("quantile_sharded", "quantile"))}


@pytest.mark.parametrize("layout", list(RULE_LAYOUTS), ids=list(RULE_LAYOUTS))
def test_order_statistics_equal_one_process(ranks, layout):
    spec = RULE_LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _body, spec):
        assert_equal_or_refused(errors, _ALONG_BLOCK_DIM if "dims" in spec else {}, TOL)
