"""Composite rules (``mesh3d.domain.ops.composite``) against one process, fp64: ``logsumexp``, ``amin``/``aminmax``,
``var_mean``/``std_mean``, ``cosine_similarity``, ``rot90``, pixel (un)shuffles and seven losses, on slabs (2 and 3
uneven ranks, an empty shard) and on a 2x2 grid of uneven blocks: values, the input's gradient, and three SGD steps
of a small conv net trained through them. Values torch's kernels refuse (a probability outside [0, 1], a class out of
range, a negative variance) raise a ValueError on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from domain_cases import RULE_LAYOUTS, assert_equal_or_refused, case_error, step_both

TOL = 1e-10
H, W = 9, 6
D64 = torch.float64


def _cases(labels: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> dict:
    """name -> fn(x, target, labels, shard): ``shard(t, from_dim)`` lays a tensor out like the input (identity in one
    process), ``from_dim`` the dim of ``t`` that is the input's dim 2."""
    return {
        "logsumexp_sharded": lambda x, t, lab, s: torch.logsumexp(x, dim=2),
        "logsumexp_all_keepdim": lambda x, t, lab, s: torch.logsumexp(x, dim=(0, 1, 2, 3), keepdim=True),
        "logsumexp_channels": lambda x, t, lab, s: x.logsumexp(1),
        "logsumexp_some_neg_inf": lambda x, t, lab, s: torch.logsumexp(x.masked_fill(x > 1.0, float("-inf")), dim=(2, 3)),
        "amin": lambda x, t, lab, s: torch.amin(x, dim=(2, 3)) + x.amin(),
        "aminmax": lambda x, t, lab, s: sum(torch.aminmax(x, dim=2)) + torch.aminmax(x).max,
        "var_mean": lambda x, t, lab, s: torch.var_mean(x, dim=(2, 3), keepdim=True)[0] * 2 + torch.var_mean(x, 2)[1].sum(),
        "std_mean_unbiased": lambda x, t, lab, s: sum(torch.std_mean(x, False)) + torch.std_mean(x, 2, True, True)[0],
        "std_mean_correction": lambda x, t, lab, s: torch.std_mean(x, dim=2, correction=0)[0],
        "cosine_channels": lambda x, t, lab, s: F.cosine_similarity(x, s(t, 2), dim=1),
        "cosine_sharded_dim": lambda x, t, lab, s: torch.cosine_similarity(x, s(t, 2), dim=2),
        "rot90": lambda x, t, lab, s: torch.rot90(x, 1, (2, 3)) * torch.rot90(x, 3, (2, 3)) + x.rot90(2, (2, 3)).sum(),
        "rot90_other_dims": lambda x, t, lab, s: x.rot90(1, (0, 1)).tanh(),
        "pixel_shuffle": lambda x, t, lab, s: F.pixel_shuffle(x, 2).sin(),
        "pixel_unshuffle_shuffle": lambda x, t, lab, s: F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2) * x,
        "smooth_l1": lambda x, t, lab, s: F.smooth_l1_loss(x, s(t, 2), beta=0.5),
        "smooth_l1_none_beta0": lambda x, t, lab, s: F.smooth_l1_loss(x, s(t, 2), reduction="none", beta=0.0),
        "huber_weighted_sum": lambda x, t, lab, s: F.huber_loss(x, s(t, 2), reduction="sum", delta=0.7,
                                                                weight=weight.view(1, -1, 1, 1).expand(2, 4, H, W)),
        "bce_logits_pos_weight": lambda x, t, lab, s: F.binary_cross_entropy_with_logits(
            x, torch.sigmoid(s(t, 2)), weight=weight.view(1, -1, 1, 1), pos_weight=weight.view(1, -1, 1, 1) + 0.5),
        "bce": lambda x, t, lab, s: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(s(t, 2)), reduction="sum"),
        "kl_div_batchmean": lambda x, t, lab, s: F.kl_div(F.log_softmax(x, 1), F.softmax(s(t, 2), 1),
                                                          reduction="batchmean"),
        "kl_div_log_target": lambda x, t, lab, s: F.kl_div(F.log_softmax(x, 1), F.log_softmax(s(t, 2), 1),
                                                           reduction="mean", log_target=True),
        "kl_div_zero_targets": lambda x, t, lab, s: F.kl_div(F.log_softmax(x, 1), torch.relu(s(t, 2)), reduction="sum"),
        "gaussian_nll": lambda x, t, lab, s: F.gaussian_nll_loss(x, s(t, 2), torch.relu(x) * 0.5, full=True, eps=0.1),
        "gaussian_nll_var_fewer_dims": lambda x, t, lab, s: F.gaussian_nll_loss(
            x.transpose(1, 3), s(t, 2).transpose(1, 3), torch.exp(x[:, 0]).transpose(1, 2) + 0.1),
        "gaussian_nll_float_var": lambda x, t, lab, s: F.gaussian_nll_loss(x, s(t, 2), 0.5, reduction="sum"),
        "nll_weighted_ignored": lambda x, t, lab, s: F.nll_loss(F.log_softmax(x, 1), s(labels, 1), weight=weight,
                                                                ignore_index=2),
        "nll_none": lambda x, t, lab, s: F.nll_loss(F.log_softmax(x, 1), s(labels, 1), reduction="none"),
    }


def _cases_body(layout: dict) -> dict:
    """Every case's largest error (value and the input's gradient) on this rank, for one layout."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 4, H, W, dtype=D64, generator=g)
    target = torch.randn(2, 4, H, W, dtype=D64, generator=g)
    labels = torch.randint(0, 4, (2, H, W), generator=g)
    weight = torch.rand(4, dtype=D64, generator=g) + 0.2

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(dim, dim + 1), sizes=layout["sizes"])
        return domain.shard(t, dim=dim, sizes=layout["sizes"])

    whole = lambda t, d: t  # noqa: E731 - one process: nothing to lay out
    errors = {name: case_error(lambda x, sharded, fn=fn: fn(shard(x, 2), target, labels, shard) if sharded
                               else fn(x, target, labels, whole), x0, i)
              for i, (name, fn) in enumerate(_cases(labels, target, weight).items())}
    if "dims" not in layout:  # an integer amax (an empty shard's part is the dtype's lowest, not -inf): its dtype too
        top = torch.amax(shard(labels, 1), dim=(1, 2))
        errors["amax_int"] = 0.0 if top.dtype == labels.dtype and torch.equal(top.to_local(), labels.amax((1, 2))) \
            else float("inf")
    DistributedManager.shutdown()
    return errors


_AMAX_PART, _PART = "torch.amax over dims [2] covers only some of the block", "torch.mean over dims [2] covers only some of the block"
#: What blocks refuse, by the part they have no rule for: a reduction over one of two block dims (amax's included).
#: (Flips, and so rot90, have a block rule; the pixel shuffles' reshape runs on slabs: issue 67.)
BLOCK_REFUSALS = {
    **dict.fromkeys(("logsumexp_sharded", "aminmax"), _AMAX_PART),
    **dict.fromkeys(("var_mean", "std_mean_unbiased", "std_mean_correction"), _PART),
    "cosine_sharded_dim": "torch.sum over dims [2] covers only some of the block",
}
LAYOUTS = RULE_LAYOUTS


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_composites_equal_one_process(ranks, layout):
    spec = LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _cases_body, spec):
        # On blocks, what needs a rule blocks lack is refused by that rule's name, never run wrong.
        assert_equal_or_refused(errors, BLOCK_REFUSALS if "dims" in spec else {}, TOL)


class _Net(torch.nn.Module):
    def __init__(self, shuffle: bool) -> None:
        super().__init__()
        self.shuffle = shuffle
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, dtype=D64)
        self.up = torch.nn.Conv2d(4, 16, 1, dtype=D64)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        y = self.up(h)
        return h, (F.pixel_unshuffle(F.pixel_shuffle(y, 2), 2) if self.shuffle else y)[:, :4]


def _train_body(layout: dict, steps: int) -> float:
    """Three SGD steps of a conv net whose loss sums composites; the largest difference from one process (losses and
    parameters after each step)."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    torch.manual_seed(0)
    ref = _Net(shuffle=True)
    mod = copy.deepcopy(ref)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)

    def shard(t: torch.Tensor, dim: int = 2) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(dim, dim + 1), sizes=layout["sizes"])
        return domain.shard(t, dim=dim, sizes=layout["sizes"])

    def loss_of(h, y, target, labels):
        loss = (F.nll_loss(F.log_softmax(h, 1), labels) + F.smooth_l1_loss(y, target, beta=0.3)
                + F.kl_div(F.log_softmax(y, 1), F.softmax(target, 1), reduction="batchmean")
                + torch.var_mean(y, dim=(2, 3))[0].mean() + F.binary_cross_entropy_with_logits(h, torch.sigmoid(target))
                + F.cosine_similarity(h, y).mean())
        return loss + 0.1 * torch.logsumexp(h, dim=(2, 3)).mean() - torch.amin(h) * 0.01

    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 3, H, W, dtype=D64, generator=g)
        target = torch.randn(2, 4, H, W, dtype=D64, generator=g)
        labels = torch.randint(0, 4, (2, H, W), generator=g)
        loss_ref = loss_of(*ref(x), target, labels)
        loss_ref.backward()
        loss = loss_of(*mod(shard(x)), shard(target), shard(labels, 1))
        loss.backward()
        worst = max(worst, step_both(ref, mod, opt_ref, opt, loss_ref, loss))
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_a_net_trained_through_composite_losses_equals_one_process(ranks, layout):
    spec = LAYOUTS[layout]
    assert max(ranks.run(spec["world"], _train_body, spec, 3)) < TOL


def _refusals_body() -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=2)
    x = torch.rand(2, 3, H, W, dtype=D64)
    xs = domain.shard(x, dim=2, sizes=(H, 0))  # the bad value sits on rank 0 alone: rank 1 must raise too
    labels = torch.zeros(2, H, W, dtype=torch.long)
    labels[0, 0, 0] = 7
    above = x.clone()
    above[0, 0, 0, 0] = 1.5
    attempts = {
        "bce_above_one": lambda: F.binary_cross_entropy(domain.shard(above, dim=2, sizes=(H, 0)), xs),
        "nll_out_of_bounds": lambda: F.nll_loss(xs, domain.shard(labels, dim=1, sizes=(H, 0))),
        "gaussian_negative_var": lambda: F.gaussian_nll_loss(xs, xs, xs - 0.5),
        "smooth_l1_negative_beta": lambda: F.smooth_l1_loss(xs, xs, beta=-1.0),
        "bad_reduction": lambda: F.huber_loss(xs, xs, reduction="average"),
        "rot90_one_dim": lambda: torch.rot90(xs, 1, (2, 2)),
        "pixel_shuffle_channels": lambda: F.pixel_shuffle(xs, 2),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    DistributedManager.shutdown()
    return messages


def test_values_torch_refuses_raise_on_every_rank(ranks):
    expected = {"bce_above_one": "must lie in [0, 1]", "nll_out_of_bounds": "out of bounds: class ids are 0..2",
                "gaussian_negative_var": "negative", "smooth_l1_negative_beta": "must not be negative",
                "bad_reduction": "reduction='average'", "rot90_one_dim": "two different dims",
                "pixel_shuffle_channels": "must divide by upscale_factor^2 = 4"}
    for messages in ranks.run(2, _refusals_body):
        for name, text in expected.items():
            assert messages[name] is not None and text in messages[name], (name, messages[name])
