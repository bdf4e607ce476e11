"""The domain planners in one process, no process group: D ranks simulated by slicing.

Every rank's exchange plan is built, the messages it would send are cut from the global tensor and
handed to the receivers, and each rank's result must be exactly the rows its map asks for; for
window ops, the rank-ordered outputs of the local kernels must concatenate to the one-process output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from domain_cases import edge_layouts, shard_sizes
from mesh3d.domain.halo.windows import window_exchange
from mesh3d.domain.halo.windows import plan_window, window_output_length
from mesh3d.domain.comm.rows import Span, map_length, plan_exchange, runs_from_indices
from mesh3d.domain.core.split import offsets_of, split_sizes
from profiles import examples


def simulate(full: torch.Tensor, sizes: tuple[int, ...], needs, fill: float = 0.0) -> list[torch.Tensor]:
    """Each rank's gathered rows (dim 0 of ``full``), by running every plan's sends and receives."""
    offsets = offsets_of(sizes)
    local = [full[o:o + s] for o, s in zip(offsets, sizes)]
    plans = [plan_exchange(sizes, needs, r) for r in range(len(sizes))]
    mailbox = {}
    for r, plan in enumerate(plans):
        for peer, runs in plan.send:
            mailbox[(r, peer)] = torch.cat([local[r][s:s + c] for s, c in runs])
    for r, plan in enumerate(plans):  # every message expected arrives, with the row count the sender sent
        for peer, count in plan.recv:
            assert mailbox[(peer, r)].shape[0] == count, (peer, r)
    assert sum(len(p.send) for p in plans) == sum(len(p.recv) for p in plans)
    out = []
    for r, plan in enumerate(plans):
        parts = []
        for p in plan.pieces:
            if p.kind == "own":
                parts.append(local[r][p.start:p.start + p.count])
            elif p.kind == "recv":
                parts.append(mailbox[(p.peer, r)][p.start:p.start + p.count])
            else:
                parts.append(torch.full((p.count, *full.shape[1:]), fill, dtype=full.dtype))
        got = torch.cat(parts) if parts else full[:0]
        assert got.shape[0] == plan.length == map_length(needs[r])
        out.append(got)
    return out


def expected_rows(full: torch.Tensor, indices: list[int], fill: float = 0.0) -> torch.Tensor:
    rows = [full[g] if g >= 0 else torch.full(full.shape[1:], fill, dtype=full.dtype) for g in indices]
    return torch.stack(rows) if rows else full[:0]


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), parts=st.integers(1, 6), length=st.integers(0, 20))
def test_any_row_map_gathers_exactly_its_rows(data, parts, length):
    full = torch.arange(length * 2, dtype=torch.float64).view(length, 2)
    row = st.integers(-1, length - 1) if length else st.just(-1)
    indices = [data.draw(st.lists(row, max_size=25)) for _ in range(parts)]
    needs = tuple(runs_from_indices(i) for i in indices)
    for sizes in (split_sizes(length, parts, data.draw(shard_sizes(length, parts))), *edge_layouts(length, parts)):
        for got, want in zip(simulate(full, sizes, needs, fill=-7.0), indices):
            assert torch.equal(got, expected_rows(full, want, fill=-7.0)), sizes


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), parts=st.integers(1, 6))
def test_window_ops_concatenate_to_the_one_process_output(data, parts):
    """conv1d and max_pool1d through the window plan + the kernel padding the dispatcher leaves to torch."""
    k, s, d = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    pl, pr = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4))
    least = max(1, d * (k - 1) + 1 - pl - pr)
    length = data.draw(st.integers(least, least + 14))
    for sizes in (split_sizes(length, parts, data.draw(shard_sizes(length, parts))), *edge_layouts(length, parts)):
        _check_window_plan(sizes, length, parts, k, s, d, pl, pr)


def _check_window_plan(sizes, length, parts, k, s, d, pl, pr):
    x = torch.randn(1, 2, length, dtype=torch.float64)
    w = torch.randn(3, 2, k, dtype=torch.float64)
    want = F.conv1d(F.pad(x, (pl, pr)), w, stride=s, dilation=d)
    plan = plan_window(sizes, k, s, d, pl, pr)
    assert sum(plan.out_sizes) == want.shape[-1] == window_output_length(length, k, s, d, pl, pr)
    outs = []
    for r in range(parts):
        xplan, pad = window_exchange(sizes, plan, r, True)
        mine = plan.out_sizes[r]
        # The rows this rank gathers, simulated on the transposed tensor (rows first).
        trimmed = list(plan.needs)  # the other ranks' maps as planned; this rank's less the kernel's padding
        trimmed[r] = _trimmed(plan.needs[r], pad)
        rows = simulate(x[0].T.contiguous(), sizes, tuple(trimmed))[r]
        ext = rows.T.unsqueeze(0)
        if mine:
            y = F.conv1d(ext, w, stride=s, dilation=d, padding=pad)
            assert y.shape[-1] == mine, (r, y.shape, mine)
            outs.append(y)
        assert xplan.length == rows.shape[0]
    assert torch.allclose(torch.cat(outs, -1), want, rtol=0, atol=1e-12)


def _trimmed(row_map, pad):
    if not pad:
        return row_map
    spans = list(row_map)
    spans[0] = Span.fill(spans[0].stop - pad)
    spans[-1] = Span.fill(spans[-1].stop - pad)
    return tuple(sp for sp in spans if sp.stop > sp.start)


@settings(max_examples=examples(100), deadline=None)
@given(parts=st.integers(1, 8), length=st.integers(1, 10**6))
def test_planning_is_o_d(parts, length):
    """Full gathers and window plans of a million rows are a handful of runs (no per-row Python)."""
    sizes = split_sizes(length, parts)
    everything = ((Span.rows(0, length),),) * parts
    for r in range(parts):
        plan = plan_exchange(sizes, everything, r)
        assert len(plan.pieces) <= parts and plan.length == length
    if length >= 3:
        plan = plan_window(sizes, 3, 1, 1, 1, 1)
        assert all(len(m) <= 3 for m in plan.needs) and sum(plan.out_sizes) == length


def test_a_second_rule_for_one_op_is_refused_unless_overridden():
    from mesh3d.domain.dispatch.registry import RULES, register

    original = RULES.get(torch.renorm) if torch.renorm in RULES else None
    assert original is None  # torch.renorm has no rule: the dispatcher raises naming it
    try:
        register(torch.renorm)(lambda input, dims: None)
        try:
            register(torch.renorm)(lambda input, dims: None)
            raise AssertionError("a duplicate rule was accepted")
        except ValueError as err:
            assert "torch.renorm already has a domain rule" in str(err) and "override=True" in str(err)
        register(torch.renorm, override=True)(lambda input, dims: "replaced")
        assert RULES.get(torch.renorm)(None, None) == "replaced"
    finally:
        RULES._rules.pop(torch.renorm, None)


@settings(max_examples=examples(100), deadline=None)
@given(units=st.lists(st.integers(0, 6), min_size=1, max_size=6), stride=st.sampled_from([2, 4]))
def test_pooling_divides_an_aligned_layout_and_upsampling_restores_it(units, stride):
    """Sizes that are multiples of the stride: a stride-s pool gives sizes/s on every rank, and an s-fold
    upsampling (transposed conv, or outputs owned by the rank of their source row) gives the sizes back."""
    from mesh3d.domain.halo.windows import sizes_by_first_index

    sizes = tuple(u * stride for u in units)
    assume(sum(sizes))
    pooled = plan_window(sizes, stride, stride, 1, 0, 0).out_sizes
    assert pooled == tuple(s // stride for s in sizes)
    n = sum(pooled)
    upsampled = sizes_by_first_index(pooled, n * stride, lambda row: row * stride)  # source row floor(o / s)
    assert upsampled == sizes
