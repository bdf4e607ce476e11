"""Reductions on blocks, token grids and graph items equal one process, forward and backward (fp64): ``torch.prod``,
``torch.amax`` and what is built on it (``amin``, ``max``/``min`` of everything, ``logsumexp``), with maxima tied
across ranks; sum, mean and prod with ``dtype=`` reduce in that dtype there, as one process does.

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


def _sharded_dims(layout: str) -> tuple[int, ...]:
    return {"blocks2": (2, 3), "blocks3": (1, 2, 3), "tokens": (1,), "graph": (2,)}[layout]


def _extremes_body(layout, grid, shape, sizes):
    """amax / amin over every dim, over the sharded dims (and one more), over a local dim, keepdim; max() / min() of
    everything; logsumexp over the sharded dims. The largest and smallest values each appear at both ends of the
    tensor (different ranks' parts in every layout here): the gradient is shared among the ties as torch shares it."""
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(2)
    whole = torch.randn(shape, dtype=torch.float64)
    first, last = (0,) * whole.ndim, tuple(n - 1 for n in whole.shape)
    whole[first] = whole[last] = 5.0
    whole[(0,) * (whole.ndim - 1) + (1,)] = whole[last[:-1] + (0,)] = -5.0
    ndim = plain(layout, whole).ndim
    held = _sharded_dims(layout)
    extra = tuple(sorted({*held, 0}))
    calls = {
        "amax()": lambda t: torch.amax(t), "amin()": lambda t: torch.amin(t),
        "max()": lambda t: torch.max(t), "min()": lambda t: t.min(),
        "amax(sharded)": lambda t: torch.amax(t, held), "amin(sharded, keepdim)": lambda t: torch.amin(t, held, True),
        "amax(sharded + 0)": lambda t: t.amax(extra), "amax(0)": lambda t: torch.amax(t, 0),
        "amax(-1, keepdim)" if ndim - 1 not in held else "amax(0, keepdim)": (
            (lambda t: torch.amax(t, -1, keepdim=True)) if ndim - 1 not in held else (lambda t: t.amax(0, keepdim=True))),
        "logsumexp(sharded)": lambda t: torch.logsumexp(t, held),
    }
    results = {}
    for name, call in calls.items():
        x = whole.clone().requires_grad_()
        ref = call(plain(layout, x))
        cot = torch.randn_like(ref)
        (ref * cot).sum().backward()
        gx, x.grad = x.grad, None
        try:
            got = call(make(layout, x, sizes))
        except NotImplementedError as err:  # graphs: amin and logsumexp over the items
            results[name] = str(err)
            continue
        if not got.spec.sharded_dims:
            out = got.to_local()
            (got * cot).sum().backward()
        else:
            out = got.full_tensor()
            (out * cot).sum().backward()
        results[name] = max(max_err(out, ref), max_err(domain_sum(x.grad), gx))
    try:
        torch.max(make(layout, whole, sizes), 0)
        results["max(dim) refused"] = "no error"
    except NotImplementedError as err:
        results["max(dim) refused"] = str(err)
    return results


@pytest.mark.parametrize("layout, world, grid, shape, sizes", CASES, ids=[c[0] for c in CASES])
def test_amax_and_what_is_built_on_it_equal_one_process_with_ties_across_ranks(ranks, layout, world, grid, shape, sizes):
    for results in ranks.run(world, _extremes_body, layout, grid, shape, sizes):
        refusal = results.pop("max(dim) refused")
        assert "torch.max with dim= or a second tensor" in refusal and "torch.amax(x, dim)" in refusal, refusal
        refused = {name for name, v in results.items() if isinstance(v, str)}
        assert refused == ({"amin()", "amin(sharded, keepdim)", "logsumexp(sharded)"} if layout == "graph" else set()), results
        assert all("along the item dim" in results[name] or "no rule" in results[name] for name in refused), results
        assert all(err < 1e-12 for name, err in results.items() if name not in refused), (layout, results)


def _dtype_body(layout, grid, shape, sizes):
    """sum, mean and prod with dtype= reduce in that dtype, as one process does; out= is refused by name."""
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(1)
    whole = (1 + 0.1 * torch.randn(shape, dtype=torch.float64)).to(torch.float16)
    x = make(layout, whole, sizes)
    results = {}
    for fn in (torch.sum, torch.mean, torch.prod):
        ref = fn(plain(layout, whole), dtype=torch.float32)
        got = fn(x, dtype=torch.float32)
        out = got.to_local() if not got.spec.sharded_dims else got.full_tensor()
        results[fn.__name__] = (str(out.dtype), max_err(out.double(), ref.double()) / max(1.0, float(ref.abs().max())))
        try:
            fn(x, 0, out=torch.empty(()))
            results[fn.__name__ + " out="] = "no error"
        except NotImplementedError as err:
            results[fn.__name__ + " out="] = str(err)
    return results


@pytest.mark.parametrize("layout, world, grid, shape, sizes", CASES, ids=[c[0] for c in CASES])
def test_reductions_with_dtype_reduce_in_it_and_out_is_refused_by_name(ranks, layout, world, grid, shape, sizes):
    for results in ranks.run(world, _dtype_body, layout, grid, shape, sizes):
        for name in ("sum", "mean", "prod"):
            dtype, err = results[name]
            assert dtype == "torch.float32" and err < 1e-5, (layout, name, results[name])
            assert f"torch.{name}(out=...) is not supported" in results[name + " out="], results
