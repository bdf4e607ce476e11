"""Ranks that take different paths (a branch on this rank's local sizes or data) all raise DomainDivergenceError;
with global sizes, deep U-Nets that branch on shapes equal one process on any split, aligned or not."""

from __future__ import annotations

import copy
import os
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from domain_cases import grads_err, max_err
from fault_cells import BranchesOnLocalShape, divergence_runs
from rankpool.pool import RankFailure
from mesh3d.domain.core.split import aligned_sizes

TOL = 1e-9


def _diverging_body(loss_after_exchange: bool, sizes):
    """Raises (the pool then restarts: a divergence leaves the group out of step, as in a real job)."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    model = BranchesOnLocalShape(loss_after_exchange)
    x = torch.randn(1, 1, sum(sizes), 6, dtype=torch.float64, requires_grad=True)  # conv a's halo has a backward
    model(domain.shard(x, dim=2, sizes=sizes)).backward()


def rank_errors(failure: RankFailure, world: int) -> list[str]:
    """Each rank's part of a RankFailure message (the traceback it raised), in rank order."""
    text = str(failure)
    parts = {}
    for rank in range(world):
        start = text.find(f"--- rank {rank} ---")
        assert start >= 0, f"rank {rank} did not raise:\n{text}"
        end = min([i for i in (text.find(f"--- rank {r} ---") for r in range(world)) if i > start] + [len(text)])
        parts[rank] = text[start:end]
    return [parts[r] for r in range(world)]


@pytest.mark.parametrize("loss_after_exchange", [True, False], ids=["forward", "backward"])
def test_a_model_branching_on_local_shapes_raises_on_every_rank(ranks, loss_after_exchange):
    """(5, 4): rank 0's local height is odd, so only it pads; both ranks name the pad and its line."""
    with pytest.raises(RankFailure) as failure:  # a hang would be a RankTimeout after 30 s instead
        ranks.run(2, _diverging_body, loss_after_exchange, (5, 4), timeout=30)
    for msg in rank_errors(failure.value, 2):
        assert "DomainDivergenceError" in msg and "ran different domain ops" in msg, msg
        assert "torch.nn.functional.pad" in msg and "fault_cells.py" in msg, msg
        assert "local sizes" in msg and "global" in msg, msg


def _unet_body(sizes_rule: str, net: str = "BasicUNet"):
    from monai.networks.nets import UNet, BasicUNet

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    if net == "BasicUNet":  # max pooling down, transposed convs up, UpCat pads a skip whose local shape differs
        ref = BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4)).double()
    else:  # strided residual convs down, transposed convs up
        ref = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 8, 16), strides=(2, 2, 2),
                   num_res_units=1).double()
    model = copy.deepcopy(ref)
    x = torch.randn(2, 1, 32, 16, dtype=torch.float64)
    target = torch.randn(2, 2, 32, 16, dtype=torch.float64)
    y_ref = ref(x)
    loss_ref = F.mse_loss(y_ref, target)
    loss_ref.backward()
    m = domain.downsampling_factor(model, x.shape, dim=2)
    multiple_of = m if sizes_rule == "aligned" else None
    xs = domain.shard(x, dim=2, multiple_of=multiple_of)
    ys = model(xs)
    loss = F.mse_loss(ys, domain.shard(target, dim=2, sizes=xs.sizes))
    loss.backward()
    return {"factor": m, "sizes": xs.sizes,
            "err": max(max_err(ys.full_tensor().to_local(), y_ref), abs(float(loss) - float(loss_ref)),
                       grads_err(ref, model))}


def test_monai_unets_equal_one_process_on_any_split(ranks):
    """BasicUNet's UpCat pads a skip to its partner's shape: with global sizes every rank pads alike, so the default
    (11, 11, 10) split, which is not a multiple of the downsampling factor 16, runs and equals one process."""
    pytest.importorskip("monai")  # the zoo extra (scripts/test.sh installs it)
    for result in ranks.run(3, _unet_body, "default", timeout=120):
        assert result["sizes"] == (11, 11, 10) and result["err"] < TOL, result
    for result in ranks.run(3, _unet_body, "aligned", timeout=120):
        assert result["factor"] == 16, result
        assert result["sizes"] == (16, 16, 0) and result["err"] < TOL, result
    for result in ranks.run(3, _unet_body, "default", "UNet", timeout=120):
        assert result["sizes"] == (11, 11, 10) and result["err"] < TOL, result


def _factor_of(model, shape, dim):
    from mesh3d import domain

    return domain.downsampling_factor(model, shape, dim)


def test_downsampling_factor_is_the_product_of_the_strides_that_shrink_the_dim():
    down = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                         nn.AvgPool2d(3, stride=2, padding=1), nn.Upsample(scale_factor=2))
    assert _factor_of(down, (1, 1, 64, 30), 2) == 8  # stride-2 conv, 2x max pool, stride-2 avg pool
    assert _factor_of(down, (1, 1, 66, 30), 2) == 8  # odd lengths floored along the way still count
    assert _factor_of(down, (1, 1, 64, 30), 3) == 8
    assert _factor_of(nn.Conv2d(1, 1, 3, padding=1), (1, 1, 8, 8), 3) == 1
    with pytest.raises(ValueError, match="out of range"):
        _factor_of(down, (1, 1, 8, 8), 4)


@given(length=st.integers(0, 200), parts=st.integers(1, 8), m=st.integers(1, 32))
def test_aligned_sizes_are_multiples_but_the_last(length, parts, m):
    sizes = aligned_sizes(length, parts, m)
    assert len(sizes) == parts and sum(sizes) == length and min(sizes) >= 0
    assert all(s % m == 0 for s in sizes[:-1])
    units = [s // m for s in sizes[:-1]] + [(sizes[-1] - length % m) // m]
    assert max(units) - min(units) <= 1  # balanced in whole multiples


def test_shard_refuses_sizes_and_multiple_of_together():
    from mesh3d import domain

    with pytest.raises(ValueError, match="not both"):
        domain.shard(torch.zeros(1, 1, 8, 8), dim=2, sizes=(8,), multiple_of=4)
    with pytest.raises(ValueError, match="positive int"):
        domain.shard(torch.zeros(1, 1, 8, 8), dim=2, multiple_of=0)


def _outside_failure_body():
    """Domain rank 1 fails in the model's own code (a library's shape check) before a conv and its process ends, as a
    script's does; rank 0 goes on into the conv's exchange with it."""
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=1, domain=-1)  # the default group timeout (minutes): no rank waits it out
    conv = torch.nn.Conv2d(1, 1, 3, padding=1)
    xs = domain.shard(torch.randn(1, 1, 8, 4), dim=2)
    if dm.axis_rank("domain") == 1:
        try:
            raise ValueError("the library's own check failed on this rank")
        except ValueError:
            traceback.print_exc()  # into this rank's log, which the RankFailure shows
            sys.stderr.flush()
            os._exit(1)
    conv(xs)


def test_a_peer_failing_outside_mesh3d_is_named_when_it_ends_not_a_hang(ranks):
    """A closed connection ends rank 0's wait at once: the error it raises names the peer as gone (not a divergence)
    and says what to do. The pool's timeout only bounds a hang (rank 0 waiting for the group timeout would be a RankTimeout)."""
    with pytest.raises(RankFailure) as failure:
        ranks.run(2, _outside_failure_body, timeout=90)
    text = str(failure.value)
    assert "--- rank 1 died (exit code 1) ---" in text and "ValueError: the library's own check failed" in text, text
    rank0 = text[text.index("--- rank 0 ---"):text.index("--- rank 1 died")]
    assert "DomainPeerLostError: rank 1 (batch 0, domain 1, model 0) is gone: its connection " \
        "closed while this rank (domain rank 0) waited for it" in rank0, text
    assert "an error outside mesh3d" in rank0 and "torch.conv2d" in rank0 and "in _outside_failure_body" in rank0, rank0



def _wrong_rows_body(uneven, op):
    """Domain rank 1's shard holds one row fewer than its layout says (what a rule with a halo one row short makes);
    then a conv (its halo exchange) or full_tensor. Each rank returns what it raised."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.tensor import unwrap, wrap

    dm = DistributedManager.initialize(batch=1, domain=-1)   # the default group timeout (minutes): none waits it out
    xs = domain.shard(torch.randn(1, 1, 12, 4), dim=2, sizes=(5, 4, 3) if uneven else None)
    if dm.axis_rank("domain") == 1:
        xs = wrap(unwrap(xs)[:, :, :-1], xs.spec)
    try:
        if op == "conv":
            torch.nn.functional.conv2d(xs, torch.ones(1, 1, 3, 3), padding=1)
        else:
            xs.full_tensor()
    except Exception as err:  # noqa: BLE001 - returned for the test to read
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("uneven, op", [(False, "full_tensor"), (True, "full_tensor"), (True, "conv")])
def test_a_shard_with_a_wrong_row_count_raises_on_every_rank_before_the_exchange(ranks, uneven, op):
    """Not a hang until the group timeout: the rank with the wrong shard refuses before its exchange and tells its
    peers, which raise in theirs; the timeout below only bounds a hang."""
    for rank, message in enumerate(ranks.run(3, _wrong_rows_body, uneven, op, timeout=60)):
        assert message and "domain rank 1's shard has 3 rows along dim 2 where its layout says 4" in message, (rank,
                                                                                                          message)


def test_a_divergence_is_named_on_every_rank_every_run(ranks):
    """Three ranks (5, 4, 4): only rank 0 pads. Runs diverging in forward and in backward, each on fresh ranks (a
    divergence leaves the groups out of step): every rank raises DomainDivergenceError every time (the issue saw 4
    of 7 runs; scripts/bench_faults.py --divergence 20 repeats this 20 times: docs/benchmarks.md)."""
    for run in divergence_runs(lambda fn, *a, **k: ranks.run(3, fn, *a, **k), 4):
        assert [kind for kind, _ in run] == ["DomainDivergenceError"] * 3, run
        assert "torch.nn.functional.pad" in run[0][1], run
