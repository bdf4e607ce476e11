"""Domain-sharded convolutions vs one process (fp64, tolerance 1e-10: only summation order may differ),
and the adjoint test of the halo exchange primitive."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain_cases import domain_sum, grads_err, max_err, shard_sizes, with_edge_layouts
from profiles import examples

TOL = 1e-10
MODES = ("zeros", "reflect", "replicate", "circular")


@st.composite
def conv_case(draw, parts: int, transpose: bool = False):
    nd = draw(st.integers(1, 3))
    k = draw(st.integers(1, 4 if nd < 3 else 3))
    s = draw(st.integers(1, 3))
    d = draw(st.integers(1, 3))
    if transpose:
        p = draw(st.integers(0, 2))
        op = draw(st.integers(0, max(s, d) - 1))
        mode = "zeros"
        least = max(1, -(-(2 * p - d * (k - 1) - op) // s) + 1)  # one-process output must be non-empty
        length = draw(st.integers(least, least + 8))
        padding = p
    else:
        op = 0
        mode = draw(st.sampled_from(MODES))
        padding = draw(st.sampled_from(["same", "valid", 0, 1, 2, 3])) if s == 1 else draw(st.integers(0, 3))
        p = d * (k - 1) // 2 + 1 if padding == "same" else (0 if padding == "valid" else padding)
        length = draw(st.integers(max(1, d * (k - 1) + 1 - 2 * p, p + 1), 13))
    sharded = draw(st.integers(0, nd - 1))
    sizes = draw(shard_sizes(length, parts))
    return dict(nd=nd, k=k, s=s, d=d, padding=padding, mode=mode, op=op, length=length, sharded=sharded, sizes=sizes)


def _make_input_and_module(case, transpose):
    nd, k = case["nd"], case["k"]
    other = 6 if transpose else max(4, case["d"] * (k - 1) + 1)
    shape = [2, 3] + [case["length"] if i == case["sharded"] else other for i in range(nd)]
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    if transpose:
        cls = getattr(torch.nn, f"ConvTranspose{nd}d")
        mod = cls(3, 4, k, stride=case["s"], padding=case["padding"], output_padding=case["op"], dilation=case["d"],
                  dtype=torch.float64)
    else:
        cls = getattr(torch.nn, f"Conv{nd}d")
        mod = cls(3, 4, k, stride=case["s"], padding=case["padding"], dilation=case["d"], padding_mode=case["mode"],
                  dtype=torch.float64)
    return x, mod


def _conv_body(cases, transpose=False):
    """Forward, input/weight/bias grads of each case vs one process; returns the worst error per case."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    errors = []
    for i, case in enumerate(cases):
        torch.manual_seed(i)
        x, ref = _make_input_and_module(case, transpose)
        mod = copy.deepcopy(ref)
        y = ref(x)
        cot = torch.randn_like(y)
        (y * cot).sum().backward()
        x_ref_grad, x.grad = x.grad, None

        xs = domain.shard(x, dim=2 + case["sharded"], sizes=case["sizes"])
        ys = mod(xs)
        full = ys.full_tensor()
        (full * cot).sum().backward()
        errors.append(max(
            max_err(full, y),
            float(tuple(ys.global_shape) != tuple(y.shape)),
            max_err(domain_sum(x.grad), x_ref_grad),
            grads_err(ref, mod),
        ))
    return errors


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=examples(15), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_conv_matches_one_process(ranks, world, data):
    cases = with_edge_layouts(data.draw(st.lists(conv_case(world), min_size=8, max_size=8)), world)
    for rank_errors in ranks.run(world, _conv_body, cases, timeout=60):
        for case, err in zip(cases, rank_errors):
            assert err < TOL, (case, err)


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=examples(10), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_conv_transpose_matches_one_process(ranks, world, data):
    cases = with_edge_layouts(data.draw(st.lists(conv_case(world, transpose=True), min_size=8, max_size=8)), world)
    for rank_errors in ranks.run(world, _conv_body, cases, True, timeout=60):
        for case, err in zip(cases, rank_errors):
            assert err < TOL, (case, err)


def test_conv_transpose_whose_first_rows_no_input_reaches_after_an_empty_shard(ranks):
    """Hypothesis seed 969752957: length 2 split (0, 2), kernel 2, stride 3, padding 2: rank 1's first output row
    gets only the bias, so the rows its kernel gives start one later and overran its shard (a negative-size bias
    block)."""
    case = dict(nd=1, k=2, s=3, d=1, padding=2, mode="zeros", op=1, length=2, sharded=0)
    cases = [dict(case, sizes=sizes) for sizes in ((0, 2), (2, 0), (1, 1))]
    cases += [dict(case, k=3, s=2, padding=1, op=1, length=3, sizes=(0, 3)), dict(case, nd=2, sizes=(0, 2))]
    for rank_errors in ranks.run(2, _conv_body, cases, True, timeout=60):
        for c, err in zip(cases, rank_errors):
            assert err < TOL, (c, err)


def test_kernels_that_span_one_row_of_the_sharded_dim_with_empty_shards(ranks):
    """A kernel one row long along the sharded dim (k=1 in 1-D, 2-D and 3-D, stride 1, no padding) runs torch's
    kernel on the shard with no window: every layout of 3 ranks, empty shards included, equal to one process."""
    base = dict(k=1, s=1, d=1, padding=0, mode="zeros", op=0, length=5)
    cases = [dict(base, nd=2, sharded=0, sizes=sizes) for sizes in ((0, 2, 3), (5, 0, 0), (2, 2, 1))]
    cases += [dict(base, nd=1, sharded=0, padding="same", sizes=(3, 0, 2)),
              dict(base, nd=3, sharded=2, padding="valid", sizes=(1, 0, 4))]
    for rank_errors in ranks.run(3, _conv_body, cases, timeout=60):
        for c, err in zip(cases, rank_errors):
            assert err < TOL, (c, err)


def _adjoint_body(seed):
    """<G x, y> == <x, G* y> summed over ranks, for random row requests (far ranks, repeats, fills)."""
    import torch.distributed as dist

    from mesh3d import DistributedManager
    from mesh3d.domain.api import domain_comm
    from mesh3d.domain.comm.exchange import gather_rows
    from mesh3d.domain.comm.rows import plan_exchange, runs_from_indices

    DistributedManager.initialize(batch=1, domain=-1)
    comm = domain_comm()
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, 11, (comm.size - 1,), generator=gen).tolist())
    bounds = [0, *cuts, 10]
    sizes = tuple(bounds[i + 1] - bounds[i] for i in range(comm.size))
    needs = tuple(tuple(torch.randint(-1, 10, (int(torch.randint(0, 15, (1,), generator=gen)),),
                                      generator=gen).tolist()) for _ in sizes)
    full = torch.randn(3, 10, 2, dtype=torch.float64, generator=gen)
    offset = sum(sizes[: comm.index])
    local = full[:, offset: offset + sizes[comm.index]].clone().requires_grad_(True)
    plan = plan_exchange(sizes, tuple(runs_from_indices(n) for n in needs), comm.index)
    gx = gather_rows(local, 1, plan, comm, fill=0.0)
    expected = torch.stack([full[:, g] if g >= 0 else torch.zeros(3, 2, dtype=torch.float64)
                            for g in needs[comm.index]], 1) if needs[comm.index] else gx.detach()
    y = torch.randn(gx.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 100 + comm.index))
    (adj,) = torch.autograd.grad(gx, local, y)
    sums = torch.stack([(gx * y).sum(), (local * adj).sum()]).detach()
    dist.all_reduce(sums, group=comm.group)
    return max_err(gx, expected), float(abs(sums[0] - sums[1]))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_exchange_adjoint(ranks, world):
    for seed in range(3):
        for fwd_err, adj_err in ranks.run(world, _adjoint_body, seed):
            assert fwd_err == 0.0
            assert adj_err < 1e-12


@st.composite
def window_case(draw, parts: int):
    """A pooling or interpolation case along a sharded dim of a random length and layout."""
    kind = draw(st.sampled_from(["max", "avg", "nearest", "linear", "adaptive_avg", "adaptive_max"]))
    k = draw(st.integers(1, 4))
    p = draw(st.integers(0, k // 2))
    length = draw(st.integers(max(1, k - 2 * p), 12))
    case = dict(kind=kind, k=k, s=draw(st.integers(1, 3)), p=p, d=draw(st.integers(1, 2)) if kind == "max" else 1,
                ceil=draw(st.booleans()) if kind == "max" else False, length=length,
                scale=draw(st.sampled_from([0.5, 1.5, 2.0, 3.0])), size=draw(st.integers(1, 15)),
                align=draw(st.booleans()), by_size=draw(st.booleans()), sizes=draw(shard_sizes(length, parts)))
    if length * case["scale"] < 1:  # the one-process output would be empty
        case["scale"] = 2.0
    if kind == "max" and _window_all_padding(length, k, case["s"], p, case["d"], case["ceil"]):
        # torch 2.13 bug in the ONE-PROCESS reference: a dilated window lying wholly in padding gives -inf
        # with out-of-range indices (5..8 for a 5-wide input), and its backward corrupts the heap
        # ("munmap_chunk(): invalid pointer"). Not a case one process can be compared with.
        case["d"] = 1
    if kind == "max" and (case["d"] * (k - 1) + 1 > length + 2 * p or p > (case["d"] * (k - 1) + 1) // 2):
        case["d"] = 1
    return case


def _window_all_padding(n, k, s, p, d, ceil):
    span = n + 2 * p - d * (k - 1) - 1
    m = (-(-span // s) if ceil else span // s) + 1
    if ceil and (m - 1) * s >= n + p:
        m -= 1
    return any(all(not 0 <= j * s - p + d * t < n for t in range(k)) for j in range(m))


def _window_fn(case):
    kind = case["kind"]
    if kind == "max":
        return lambda x: F.max_pool2d(x, (case["k"], 2), (case["s"], 1), (case["p"], 0), (case["d"], 1), case["ceil"])
    if kind == "avg":
        return lambda x: F.avg_pool2d(x, (case["k"], 2), (case["s"], 1), (case["p"], 0))
    if kind.startswith("adaptive"):
        fn = F.adaptive_avg_pool2d if kind == "adaptive_avg" else F.adaptive_max_pool2d
        return lambda x: fn(x, (case["size"], 3))
    mode = "nearest" if kind == "nearest" else "bilinear"
    align = case["align"] if mode == "bilinear" else None
    if case["by_size"]:
        return lambda x: F.interpolate(x, size=(case["size"], 7), mode=mode, align_corners=align)
    return lambda x: F.interpolate(x, scale_factor=case["scale"], mode=mode, align_corners=align)


def _window_body(cases):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    errors = []
    for i, case in enumerate(cases):
        torch.manual_seed(i)
        x = torch.randn(2, 3, case["length"], 5, dtype=torch.float64, requires_grad=True)
        fn = _window_fn(case)
        y = fn(x)
        cot = torch.randn_like(y)
        (y * cot).sum().backward()
        gx, x.grad = x.grad, None
        full = fn(domain.shard(x, dim=2, sizes=case["sizes"])).full_tensor()
        (full * cot).sum().backward()
        errors.append(max(max_err(full.to_local(), y), max_err(domain_sum(x.grad), gx)))
    return errors


F = torch.nn.functional


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=examples(10), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_pool_and_interpolate_match_one_process(ranks, world, data):
    cases = with_edge_layouts(data.draw(st.lists(window_case(world), min_size=10, max_size=10)), world)
    for rank_errors in ranks.run(world, _window_body, cases, timeout=60):
        for case, err in zip(cases, rank_errors):
            assert err < TOL, (case, err)
