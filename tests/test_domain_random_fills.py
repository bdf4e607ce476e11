"""Random fills and ``nn.init`` on domain tensors against one process: the in-place draws (``normal_``, ``uniform_``,
``bernoulli_``, ``exponential_``, ``random_``, ``log_normal_``, ``geometric_``, ``cauchy_``), ``rand_like``,
``randn_like``, ``randint_like`` and ``nn.init``'s initialisers give the numbers one process draws from the same seed,
bitwise, and leave the generator where one process leaves it (the next draw equal), on slabs of 2 and 3 uneven ranks
(an empty shard) and 2x2 uneven blocks. In-place fills return the tensor itself; a fill overwriting a tensor with
history passes no gradient to that history, as torch's; a tensor argument is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from domain_cases import RULE_LAYOUTS, assert_equal_or_refused

H, W = 9, 6

#: ``fn(t)`` on a zero tensor of shape (2, 3, H, W); the in-place ones end with ``_``.
CASES = {
    "normal_": lambda t: t.normal_(0.5, 2.0), "uniform_": lambda t: t.uniform_(-1, 2),
    "bernoulli_": lambda t: t.bernoulli_(0.3), "exponential_": lambda t: t.exponential_(2.0),
    "random_": lambda t: t.random_(0, 7), "log_normal_": lambda t: t.log_normal_(), "geometric_": lambda t: t.geometric_(0.4),
    "cauchy_": lambda t: t.cauchy_(), "rand_like": torch.rand_like,
    "randn_like f64": lambda t: torch.randn_like(t, dtype=torch.float64),
    "randint_like low high": lambda t: torch.randint_like(t, 3, 9), "randint_like high": lambda t: torch.randint_like(t, 9),
    "init.normal_": lambda t: nn.init.normal_(t, 0.5, 2.0), "init.uniform_": lambda t: nn.init.uniform_(t, -1, 2),
    "init.constant_": lambda t: nn.init.constant_(t, 0.3), "init.trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "init.xavier_uniform_": nn.init.xavier_uniform_, "init.xavier_normal_": nn.init.xavier_normal_,
    "init.kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=0.1),
    "init.kaiming_normal_ fan_out": lambda t: nn.init.kaiming_normal_(t, mode="fan_out"),
}
#: Blocks lack ``new_tensor`` (trunc_normal_'s bounds); refused by name.
BLOCK_REFUSALS = {"init.trunc_normal_": "torch.Tensor.new_tensor has no rule for block layouts"}


def _body(layout: dict) -> dict:
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=layout["grid"])
    x = torch.zeros(2, 3, H, W)

    def shard(t: torch.Tensor) -> torch.Tensor:
        if "dims" in layout:
            return domain.shard(t, dims=(2, 3), sizes=layout["sizes"])
        return domain.shard(t, dim=2, sizes=layout["sizes"])

    errors: dict = {}
    for name, fn in CASES.items():
        torch.manual_seed(3)
        want, next_want = fn(x.clone()), torch.rand(3)
        xs = shard(x.clone())
        torch.manual_seed(3)
        try:
            got = fn(xs)
        except NotImplementedError as refusal:
            errors[name] = str(refusal).split(":")[0]
            continue
        same = torch.equal(got.full_tensor().to_local(), want) and torch.equal(torch.rand(3), next_want)
        in_place = not name.endswith("_") or name.startswith("init.") or got is xs
        errors[name] = 0.0 if same and in_place and type(got) is type(xs) else float("inf")
    # a fill over a tensor with history: no gradient reaches that history (torch's NormalBackward is zero)
    w = torch.full((1, 3, 1, 1), 2.0, requires_grad=True)
    h = shard(x.clone() + 1) * w
    h.normal_()
    (h * h).sum().backward()
    errors["history_gets_no_gradient"] = float(w.grad.abs().max()) if w.grad is not None else 0.0
    try:
        shard(x.clone()).bernoulli_(torch.full((2, 3, H, W), 0.5))
        errors["tensor_argument"] = float("inf")
    except NotImplementedError as err:
        errors["tensor_argument"] = 0.0 if "torch.Tensor.bernoulli_ with a tensor argument" in str(err) else float("inf")
    DistributedManager.shutdown()
    return errors


LAYOUTS = RULE_LAYOUTS


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_random_fills_and_initialisers_draw_what_one_process_draws(ranks, layout):
    spec = LAYOUTS[layout]
    for errors in ranks.run(spec["world"], _body, spec):
        assert_equal_or_refused(errors, BLOCK_REFUSALS if "dims" in spec else {}, 1e-12)  # each 0 (bitwise) or inf
