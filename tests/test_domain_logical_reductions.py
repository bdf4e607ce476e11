"""Truth tests, NaN-aware reductions, one-hot encodings, broadcasting, matrix transposes and gathers along an unsharded
dim on domain tensors against
one process (fp64): ``any``/``all``/``count_nonzero`` (whole and along dims), ``allclose``/``isclose``,
``equal``, ``nansum``/``nanmean`` (values and gradients, NaNs on one shard only), ``F.one_hot``, ``torch.broadcast_tensors`` (and
``torch.distributions.Normal(xs, s).log_prob``, which calls it), ``.mT`` and ``.mH``, on slabs of 2 and 3 uneven ranks
(an empty shard) and 2x2 uneven blocks. A one-hot index out of range raises on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domain_cases import RULE_LAYOUTS, assert_equal_or_refused, case_error

TOL = 1e-10
H, W = 9, 6
D64 = torch.float64


def _values() -> dict:
    """Integer and boolean answers, ``fn(x, labels)``: compared exactly (no gradient)."""
    return {
        "any": lambda x, lab: (x > 2.5).any(), "any_dim": lambda x, lab: (x > 1).any(dim=2),
        "all": lambda x, lab: (x > -9).all(), "all_dim": lambda x, lab: (x > -1).all(3),
        "all_false": lambda x, lab: (x > 0).all(), "count_nonzero": lambda x, lab: torch.count_nonzero(x > 0),
        "count_nonzero_dims": lambda x, lab: torch.count_nonzero(x > 0, dim=(1, 2)),
        "isclose": lambda x, lab: torch.isclose(x, x + 1e-9), "one_hot": lambda x, lab: F.one_hot(lab, 4),
        "one_hot_inferred": lambda x, lab: F.one_hot(lab),
    }


def _grads() -> dict:
    return {
        "nansum": lambda x: torch.nansum(x.masked_fill(x > 1.2, float("nan"))),
        "nansum_dim": lambda x: x.masked_fill(x < -1.5, float("nan")).nansum(dim=2),
        "nanmean_dims": lambda x: torch.nanmean(x.masked_fill(x > 1.0, float("nan")), dim=(2, 3)),
        "broadcast_tensors": lambda x: torch.broadcast_tensors(x, x[:, :1] * 2)[1] * x,
        "normal_log_prob": lambda x: torch.distributions.Normal(x, 0.5 + x.abs()).log_prob(x * 0.3),
        "mT": lambda x: x.mT.sin(),
        "mH": lambda x: x.mH * 2,
        "gather_classes": lambda x: x.gather(1, (x.detach() > 0).long()[:, :2] * 2) * 3,
        "take_along_dim": lambda x: torch.take_along_dim(x, (x.detach() * 3).long().clamp(0, 2)[:, :2], dim=1).cos(),
    }


def _body(layout: dict) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 3, H, W, dtype=D64, generator=g)
    labels = torch.randint(0, 4, (2, H, W), generator=g)

    def shard(t: torch.Tensor, dim: int = 2) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(dim, dim + 1), sizes=layout["sizes"])
        return domain.shard(t, dim=dim, sizes=layout["sizes"])

    def whole(v):
        if not isinstance(v, domain.DomainTensor):
            return v
        return v.to_local() if v.spec.layout is domain.Layout.REPLICATED else v.full_tensor().to_local()

    errors: dict = {}
    for name, fn in _values().items():
        want = fn(x0, labels)
        try:
            got = whole(fn(shard(x0), shard(labels, 1)))
        except NotImplementedError as refusal:
            errors[name] = str(refusal).split(":")[0]
            continue
        errors[name] = 0.0 if got.dtype == want.dtype and torch.equal(got, want) else float("inf")
    errors["allclose"] = 0.0 if (torch.allclose(shard(x0), shard(x0 + 1e-9)), torch.allclose(shard(x0), shard(x0 + 1e-3))) \
        == (True, False) else float("inf")
    # torch.equal: one element changed on one rank's rows only, NaNs, a plain operand, other sizes, promoted dtypes
    changed, nans = x0.clone(), x0.clone()
    changed[1, 2, H - 1, W - 1] += 1.0
    nans[0, 0, 0, 0] = float("nan")
    pairs = ((x0, x0.clone()), (x0, changed), (nans, nans), (x0.round(), x0.round().long()))
    want = [torch.equal(a, b) for a, b in pairs] + [True, False]
    got = [torch.equal(shard(a), shard(b)) for a, b in pairs] + [shard(x0).equal(x0.clone()),
                                                                 torch.equal(shard(x0), shard(x0)[:, :2])]
    errors["equal"] = 0.0 if got == want == [True, False, False, True, True, False] else float("inf")
    for i, (name, fn) in enumerate(_grads().items()):
        errors[name] = case_error(lambda x, sharded, fn=fn: fn(shard(x) if sharded else x), x0, i)
    try:  # along the sharded dim the indices would be other ranks' rows: refused by name
        shard(x0).gather(2, shard(torch.zeros(2, 3, H, W, dtype=torch.long)))
        errors["gather_sharded_dim"] = float("inf")
    except NotImplementedError as err:
        errors["gather_sharded_dim"] = 0.0 if "gather" in str(err) else float("inf")
    bad = labels.clone()
    bad[0, 0, 0] = 4
    try:
        F.one_hot(shard(bad, 1), 4)
        errors["one_hot_out_of_range"] = float("inf")
    except ValueError as err:
        errors["one_hot_out_of_range"] = 0.0 if "outside 0..3" in str(err) else float("inf")
    DistributedManager.shutdown()
    return errors


LAYOUTS = RULE_LAYOUTS
#: Blocks reduce over all their block dims or none (one_hot's inferred class count, an amax of everything, runs).
BLOCK_REFUSALS = {"any_dim": "torch.sum over dims [2] covers only some", "all_dim": "torch.sum over dims [3] covers",
                  "count_nonzero_dims": "torch.sum over dims [1, 2] covers only some", "nansum_dim": "torch.sum over dims [2]",
                  "gather_classes": "torch.Tensor.gather has no rule for block layouts",
                  "take_along_dim": "torch.take_along_dim has no rule for block layouts"}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_truth_tests_nan_reductions_and_shapes_equal_one_process(ranks, layout):
    spec = LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _body, spec):
        assert_equal_or_refused(errors, BLOCK_REFUSALS if "dims" in spec else {}, TOL)
