"""``torch.prod`` on blocks, token grids and graph items equals one process, forward and backward (fp64).

Each layout of the layout sweep (``layout_cases``: 2-D and 3-D blocks with an empty block, a token grid, graph nodes
whose owners interleave with an empty part) takes ``prod`` over everything, over each dim (the sharded ones
included where one dim holds all of them) with and without ``keepdim``, and with ``dtype=``; values near 1 with exact
zeros in some rows, so the backward's zero handling (torch's own: no division) is exercised. A dim that holds only
some of a block tensor's sharded dims is refused by name, as ``sum`` is.
"""

from __future__ import annotations

import pytest
import torch

from domain_cases import domain_sum, max_err
from layout_cases import make, plain

CASES = [  # layout, world, grid, shape, sizes (the sweep's)
    ("blocks2", 4, (2, 2), (2, 3, 7, 5), ((7, 0), (2, 3))),
    ("blocks3", 4, (1, 2, 2), (2, 3, 7, 5), ((3,), (1, 6), (5, 0))),
    ("tokens", 4, (2, 2), (2, 3, 6, 4), ((5, 1), (2, 2))),
    ("graph", 3, (3,), (2, 3, 7, 4), (4, 0, 3)),
]


def _calls(ndim: int) -> list[tuple[str, dict]]:
    out = [("all", {}), ("all, dtype", {"dtype": torch.float32})]
    for d in range(-1, ndim):
        out += [(f"dim={d}", {"dim": d}), (f"dim={d}, keepdim", {"dim": d, "keepdim": True})]
    return out


def _prod_body(layout, grid, shape, sizes):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    whole = 1 + 0.1 * torch.randn(shape, dtype=torch.float64)
    whole[0, 1, 3] = 0.0  # a zero in one shard's rows, and one more in a row that then holds two
    whole[1, 2, 5, 1] = 0.0
    whole[1, 2, 5, 3] = 0.0
    results = {}
    ndim = plain(layout, whole).ndim
    for name, kwargs in _calls(ndim):
        x = whole.clone().requires_grad_()
        ref = torch.prod(plain(layout, x), **kwargs)
        cot = torch.randn_like(ref)
        (ref * cot).sum().backward()
        gx, x.grad = x.grad, None
        try:
            got = torch.prod(make(layout, x, sizes), **kwargs)
        except NotImplementedError as err:
            results[name] = str(err)
            continue
        if not got.spec.sharded_dims:  # replicated: backward on it directly (the gradient convention)
            out = got.to_local()
            (got * cot).sum().backward()
        else:
            out = got.full_tensor()
            (out * cot).sum().backward()
        same_dtype = out.dtype == ref.dtype
        results[name] = max(max_err(out.double(), ref.double()), max_err(domain_sum(x.grad), gx)) if same_dtype else "dtype"
    return results


@pytest.mark.parametrize("layout, world, grid, shape, sizes", CASES, ids=[c[0] for c in CASES])
def test_prod_equals_one_process_forward_and_backward(ranks, layout, world, grid, shape, sizes):
    per_rank = ranks.run(world, _prod_body, layout, grid, shape, sizes)
    for results in per_rank:
        assert results == per_rank[0]  # every rank the same verdict
        for name, verdict in results.items():
            if isinstance(verdict, str):  # refused: only a dim holding some of a block tensor's sharded dims
                assert layout.startswith("blocks") and "covers only some of the block-sharded dims" in verdict, (name, verdict)
            else:
                assert verdict < 1e-12, (layout, name, verdict)
    refused = [n for n, v in per_rank[0].items() if isinstance(v, str)]
    assert len(refused) == {"blocks2": 6, "blocks3": 8}.get(layout, 0), refused
