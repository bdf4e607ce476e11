"""Window ops with the halo exchange overlapped: the strip split reproduces the kernel (in process, no
group), and overlapped convs equal one process and the plain path, forward, backward and training (fp64)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from domain_cases import domain_sum, edge_layouts, grads_err, max_err, shard_sizes, sum_grads_over_domain, with_edge_layouts
from mesh3d.domain.halo.windows import window_exchange
from mesh3d.domain.halo.windows import plan_window
from mesh3d.domain.halo.overlap import split_window
from mesh3d.domain.core.split import offsets_of, split_sizes
from profiles import examples

TOL = 1e-10


def _extended_rows(x: torch.Tensor, plan, pad: int, offset: int) -> torch.Tensor:
    """A rank's extended input (kernel padding, gathered pieces, padding), built from the global tensor."""
    parts = [x.new_zeros(x.shape[0], x.shape[1], pad)]
    for p in plan.pieces:
        if p.kind == "fill":
            parts.append(x.new_zeros(x.shape[0], x.shape[1], p.count))
        elif p.kind == "own":
            parts.append(x[..., offset + p.start: offset + p.start + p.count])
        else:
            parts.append(None)  # filled below from the global rows this piece stands for
    return parts


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), parts=st.integers(2, 6))
def test_strips_and_interior_concatenate_to_the_kernel_output(data, parts):
    """Left strip + interior (own rows only) + right strip == the kernel on the whole extended input."""
    k, s, d = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    p = data.draw(st.integers(0, 4))
    least = max(1, d * (k - 1) + 1 - 2 * p)
    length = data.draw(st.integers(least, least + 20))
    for sizes in (split_sizes(length, parts, data.draw(shard_sizes(length, parts))), *edge_layouts(length, parts)):
        _check_strips(sizes, length, k, s, d, p)


def _check_strips(sizes, length, k, s, d, p):
    x = torch.randn(1, 2, length, dtype=torch.float64)
    w = torch.randn(3, 2, k, dtype=torch.float64)
    plan = plan_window(sizes, k, s, d, p, p)
    outs = []
    for r, offset in enumerate(offsets_of(sizes)):
        xplan, pad = window_exchange(sizes, plan, r, True)
        mine = plan.out_sizes[r]
        # the extended rows, in global terms: trimmed needs of this rank, padding left to the kernel
        needs = plan.needs[r]
        rows = []
        for span in needs:
            rows.append(x.new_zeros(1, 2, span.stop - span.start) if span.is_fill else x[..., span.start:span.stop])
        ext = torch.cat(rows, -1) if rows else x[..., :0]  # includes the kernel padding as zero rows
        if not mine:
            continue
        whole = F.conv1d(ext, w, stride=s, dilation=d)
        assert whole.shape[-1] == mine
        split = split_window(xplan, pad, d * (k - 1) + 1, s, mine)
        if split is None:
            outs.append(whole)
            continue
        before = pad + sum(q.count for q in split.lead)
        start, count = split.interior
        interior = F.conv1d(x[..., offset + start: offset + start + count], w, stride=s, dilation=d)
        pieces = [F.conv1d(ext[..., :split.left_rows], w, stride=s, dilation=d)] if split.left_rows else []
        pieces.append(interior)
        if split.right_rows:
            pieces.append(F.conv1d(ext[..., ext.shape[-1] - split.right_rows:], w, stride=s, dilation=d))
        got = torch.cat(pieces, -1)
        assert torch.allclose(got, whole, rtol=0, atol=1e-12), (r, split)
        assert split.left_own == min(max(split.left_rows - before, 0), split.own.count)
        outs.append(got)
    want = F.conv1d(F.pad(x, (p, p)), w, stride=s, dilation=d)
    assert torch.allclose(torch.cat(outs, -1), want, rtol=0, atol=1e-12)


def test_a_thick_interior_shard_of_a_same_conv_overlaps():
    """The common case is covered: a 3x3 'same' conv on a middle rank with 5 rows reads its whole shard."""
    sizes = (5, 5, 5)
    xplan, pad = window_exchange(sizes, plan_window(sizes, 3, 1, 1, 1, 1), 1, True)
    split = split_window(xplan, pad, 3, 1, 5)
    assert split is not None and split.interior == (0, 5) and split.left_rows == split.right_rows == 3
    thin = (5, 1, 5)  # one row: every output needs a remote row, no interior
    xplan, pad = window_exchange(thin, plan_window(thin, 3, 1, 1, 1, 1), 1, True)
    assert split_window(xplan, pad, 3, 1, 1) is None


@st.composite
def conv_stack_case(draw, parts: int):
    nd = draw(st.integers(1, 3))
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        k, s, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
        layers.append((k, s, d, draw(st.integers(0, 2))))
    length = draw(st.integers(12, 24))
    sizes = draw(shard_sizes(length, parts))
    return dict(nd=nd, layers=layers, length=length, sizes=sizes)


def _stack(case):
    nd = case["nd"]
    conv = getattr(torch.nn, f"Conv{nd}d")
    mods, ch = [], 2
    for k, s, d, p in case["layers"]:
        mods += [conv(ch, 3, k, stride=s, padding=p, dilation=d, dtype=torch.float64), torch.nn.Tanh()]
        ch = 3
    return torch.nn.Sequential(*mods)


OTHER = 7  # the length of the unsharded spatial dims


def _fits(case) -> bool:
    """Every layer's output is non-empty along the sharded dim and the others."""
    for n in (case["length"], OTHER):
        for k, s, d, p in case["layers"]:
            n = (n + 2 * p - d * (k - 1) - 1) // s + 1
            if n < 1:
                return False
    return True


def _overlap_body(cases):
    """Each conv stack: one process vs overlap on vs overlap off; forward, input and weight gradients."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.halo.overlap import OVERLAP_STATS

    DistributedManager.initialize(batch=1, domain=-1)
    worst, calls = 0.0, OVERLAP_STATS.calls
    for i, case in enumerate(cases):
        torch.manual_seed(i)
        ref = _stack(case)
        x = torch.randn([2, 2] + [case["length"]] + [OTHER] * (case["nd"] - 1), dtype=torch.float64, requires_grad=True)
        y = ref(x)
        cot = torch.randn_like(y)
        (y * cot).sum().backward()
        for enabled in (True, False):
            mod = copy.deepcopy(ref)
            mod.zero_grad()
            xi = x.detach().requires_grad_(True)
            with domain.window_overlap(enabled):
                ys = mod(domain.shard(xi, dim=2, sizes=case["sizes"]))
                full = ys.full_tensor()
                (full * cot).sum().backward()
            worst = max(worst, max_err(full, y), max_err(domain_sum(xi.grad), x.grad), grads_err(ref, mod))
    return worst, OVERLAP_STATS.calls - calls


@settings(max_examples=examples(4), deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # a rank-pool failure is not shrunk (slow)
@given(data=st.data())
def test_overlapped_conv_stacks_equal_one_process(ranks, data):
    for world in (2, 3):
        drawn = with_edge_layouts([data.draw(conv_stack_case(world)) for _ in range(6)], world)
        cases = [c for c in drawn if _fits(c)]
        # and one stack that surely overlaps on every rank (a 'same' conv, then a strided dilated one)
        cases.append(dict(nd=2, layers=[(3, 1, 1, 1), (3, 2, 2, 2)], length=23, sizes=(8, 15) if world == 2 else (8, 7, 8)))
        results = ranks.run(world, _overlap_body, cases)
        assert max(r[0] for r in results) < TOL, results
        assert all(r[1] > 0 for r in results), results


def _training_body(steps: int):
    """A 2-D conv stack trained with SGD on 3 uneven ranks (one empty) with overlap on, vs one process."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.halo.overlap import OVERLAP_STATS

    dm = DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1, dtype=torch.float64), torch.nn.GELU(),
                              torch.nn.Conv2d(4, 4, 5, padding=2, dtype=torch.float64), torch.nn.GELU(),
                              torch.nn.Conv2d(4, 1, 3, padding=1, dtype=torch.float64))
    mod = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    calls, worst = OVERLAP_STATS.calls, 0.0
    for step in range(steps):
        x = torch.randn(2, 2, 19, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        loss_ref = (ref(x) ** 2).mean()
        loss_ref.backward()
        loss = (mod(domain.shard(x, dim=2, sizes=(9, 0, 10))) ** 2).mean()
        loss.backward()
        sum_grads_over_domain(mod.parameters())
        worst = max(worst, abs(float(loss) - float(loss_ref)))
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    worst = max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))
    return worst, OVERLAP_STATS.calls - calls, dm.axis_size("domain")


def test_training_with_overlap_equals_one_process(ranks):
    results = ranks.run(3, _training_body, 4)
    assert max(r[0] for r in results) < TOL, results
    # ranks 0 and 2 (rows 0-8 and 9-18) each overlap all three convs, forward, every step
    assert [r[1] for r in results] == [12, 0, 12], results
