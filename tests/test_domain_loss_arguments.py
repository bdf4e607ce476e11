"""Loss arguments a rule must read as torch reads them, against one process (fp64, values and gradients): the legacy
``size_average``/``reduce`` (deprecated, still honoured by torch: ``reduce=False`` is ``reduction='none'``) of
``F.mse_loss``, ``F.l1_loss`` and ``F.cross_entropy``, and the ``weight`` of ``F.mse_loss``/``F.l1_loss`` (a plain or a
sharded tensor of the input's shape; its mean divides by the weights' sum), on slabs of 2 and 3 uneven ranks (an
empty shard) and 2x2 uneven blocks, where a weight is refused by name. Before, every one of these ran and answered
the default reduction's value, or ignored the weight: silently wrong."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from domain_cases import RULE_LAYOUTS, assert_equal_or_refused, case_error

TOL = 1e-10
H, W = 9, 6
D64 = torch.float64


def _body(layout: dict) -> dict:
    from mesh3d import DistributedManager, domain

    warnings.simplefilter("ignore", UserWarning)  # NOTE: torch warns that size_average and reduce are deprecated
    DistributedManager.initialize(batch=1, domain=layout["grid"])
    g = torch.Generator().manual_seed(11)
    target = torch.randn(2, 3, H, W, dtype=D64, generator=g)
    weight = torch.rand(2, 3, H, W, dtype=D64, generator=g) + 0.1
    labels = torch.randint(0, 3, (2, H, W), generator=g)

    def shard(t: torch.Tensor, dim: int = 2) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(dim, dim + 1), sizes=layout["sizes"])
        return domain.shard(t, dim=dim, sizes=layout["sizes"])

    def on(x, sharded, fn, *plain):
        return fn(shard(x), *(shard(p, 2 if p.ndim == 4 else 1) for p in plain)) if sharded else fn(x, *plain)

    cases = {
        "mse reduce=False": lambda x, s: on(x, s, lambda a, b: F.mse_loss(a, b, reduce=False), target),
        "mse size_average=False": lambda x, s: on(x, s, lambda a, b: F.mse_loss(a, b, size_average=False), target),
        "l1 reduce=False": lambda x, s: on(x, s, lambda a, b: F.l1_loss(a, b, reduce=False), target),
        "l1 size_average=False": lambda x, s: on(x, s, lambda a, b: F.l1_loss(a, b, size_average=False, reduce=True),
                                                  target),
        "mse weight mean": lambda x, s: on(x, s, lambda a, b: F.mse_loss(a, b, weight=weight), target),
        "mse weight sum": lambda x, s: on(x, s, lambda a, b: F.mse_loss(a, b, reduction="sum", weight=weight), target),
        "mse weight none": lambda x, s: on(x, s, lambda a, b, w: F.mse_loss(a, b, reduction="none", weight=w), target,
                                           weight),
        "l1 weight mean sharded": lambda x, s: on(x, s, lambda a, b, w: F.l1_loss(a, b, weight=w), target, weight),
        "ce reduce=False": lambda x, s: on(x, s, lambda a, t: F.cross_entropy(a, t, reduce=False), labels),
        "ce size_average=False": lambda x, s: on(x, s, lambda a, t: F.cross_entropy(a, t, size_average=False), labels),
    }
    x0 = torch.randn(2, 3, H, W, dtype=D64, generator=g)
    errors = {name: case_error(fn, x0, i) for i, (name, fn) in enumerate(cases.items())}
    DistributedManager.shutdown()
    return errors


#: Blocks refuse a weight by name (multiply the reduction="none" loss instead) and have no cross_entropy rule.
BLOCK_REFUSALS = {"mse weight mean": "F.mse_loss with weight= on", "mse weight sum": "F.mse_loss with weight= on",
                  "mse weight none": "F.mse_loss with weight= on", "l1 weight mean sharded": "F.l1_loss with weight= on",
                  "ce reduce=False": "torch.nn.functional.cross_entropy has no rule for block layouts",
                  "ce size_average=False": "torch.nn.functional.cross_entropy has no rule for block layouts"}


@pytest.mark.parametrize("layout", list(RULE_LAYOUTS), ids=list(RULE_LAYOUTS))
def test_legacy_reductions_and_weights_of_losses_equal_one_process(ranks, layout):
    spec = RULE_LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _body, spec):
        assert_equal_or_refused(errors, BLOCK_REFUSALS if "dims" in spec else {}, TOL)
