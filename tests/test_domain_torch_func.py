"""``torch.func`` over a model's parameters with a domain input that the function captures, against one process (fp64):
``torch.func.grad_and_value`` of a loss through halo convolutions (zero and circular padding), GroupNorm, an in-place
ReLU, max pooling, interpolation and a skip ``cat``, two SGD steps taken with its gradients (summed over the domain, as
``backward``'s are), on slabs at 2 uneven ranks and 3 with an empty shard and on a 2x2 block grid. Before, the rules'
autograd Functions failed inside the transform (torch asked for ``setup_context``), and a loss was a replicated domain
tensor the transform did not track (gradients of zero). A domain tensor passed to the transform, which wraps it, and
forward mode (``torch.func.jvp``) are refused by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domain_cases import domain_sum, max_err, refusals

D64 = torch.float64


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.gn = nn.Conv2d(2, 4, 3, padding=1, dtype=D64), nn.GroupNorm(2, 4, dtype=D64)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular", dtype=D64)
        self.c3 = nn.Conv2d(8, 1, 1, dtype=D64)

    def forward(self, t):
        h = torch.relu_(self.gn(self.c1(t)))
        k = F.interpolate(F.max_pool2d(F.silu(self.c2(h)), 3, 1, 1), scale_factor=1, mode="nearest")
        return self.c3(torch.cat([h, k], 1))


def _body(layout):
    from torch.func import functional_call, grad, grad_and_value, jvp

    from mesh3d import DistributedManager, domain

    grid = layout == "2x2 blocks"
    DistributedManager.initialize(batch=1, domain=(2, 2) if grid else len(layout))
    try:
        torch.manual_seed(0)
        model = _Net()
        x = torch.randn(2, 2, 9, 7, dtype=D64)
        xs = domain.shard(x, dims=(2, 3), sizes=((4, 5), (3, 4))) if grid else domain.shard(x, dim=2, sizes=layout)

        def loss(p, t):
            return functional_call(model, p, (t,)).pow(2).mean()

        ref = {k: v.detach().clone() for k, v in model.named_parameters()}
        mine = {k: v.clone() for k, v in ref.items()}
        worst = 0.0
        for _ in range(2):
            g_ref, l_ref = grad_and_value(loss)(ref, x)
            g, l_dom = grad_and_value(lambda p: loss(p, xs))(mine)
            g = {k: domain_sum(v) for k, v in g.items()}
            worst = max(worst, abs(float(l_dom) - float(l_ref)), *(max_err(g[k], g_ref[k]) for k in ref))
            ref = {k: v - 0.1 * g_ref[k] for k, v in ref.items()}
            mine = {k: v - 0.1 * g[k] for k, v in mine.items()}
        worst = max(worst, *(max_err(mine[k], ref[k]) for k in ref))
        ones = {k: torch.ones_like(v) for k, v in mine.items()}
        return worst, refusals({"passed to grad": lambda: grad(loss)(mine, xs),
                                "jvp": lambda: jvp(lambda p: loss(p, xs), (mine,), (ones,))})
    finally:
        DistributedManager.shutdown()


def test_torch_func_grad_over_parameters_with_a_captured_domain_input_is_one_process(ranks):
    for layout in ((4, 5), (3, 0, 6), "2x2 blocks"):
        world = 4 if layout == "2x2 blocks" else len(layout)
        for rank, (worst, refused) in enumerate(ranks.run(world, _body, layout, timeout=240)):
            assert worst < 1e-12, (layout, rank, worst)
            assert "reached a domain tensor below mesh3d's rules" in refused["passed to grad"] and \
                "capture the domain tensor in the function" in refused["passed to grad"], (layout, rank, refused)
            assert "under a torch.func transform" in refused["jvp"], (layout, rank, refused)
