"""torch.optim's optimizers on a domain tensor that is itself the leaf being optimized (an inverse problem's field, a
PINN's initial condition): Adam and AdamW failed on ``lerp_`` (no rule; issue 64's outside hunt), SGD with momentum
ran. Each takes three steps of a loss through a halo convolution, in fp64, on slabs (9,), (1, 8) and (4, 0, 5), against
the same optimizer on the whole tensor in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domain_cases import max_err

D64 = torch.float64
OPTIMIZERS = {
    "SGD with momentum": lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True),
    "Adam": lambda p: torch.optim.Adam([p], lr=0.05),
    "AdamW with amsgrad": lambda p: torch.optim.AdamW([p], lr=0.05, weight_decay=0.1, amsgrad=True),
    "RMSprop": lambda p: torch.optim.RMSprop([p], lr=0.01, momentum=0.5),
}


def _loss(u, w):
    return (F.conv2d(u, w, padding=1) - 1.0).pow(2).mean()


def _body(sizes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=len(sizes))
    try:
        x = torch.randn(1, 2, sum(sizes), 5, dtype=D64, generator=torch.Generator().manual_seed(6))
        w = torch.randn(2, 2, 3, 3, dtype=D64, generator=torch.Generator().manual_seed(7))
        errors = {}
        for name, make in OPTIMIZERS.items():
            ref = x.clone().requires_grad_()
            field = domain.shard(x.clone(), dim=2, sizes=sizes).requires_grad_()
            opts = make(ref), make(field)
            worst = 0.0
            for _ in range(3):
                for opt, u in zip(opts, (ref, field)):
                    opt.zero_grad()
                    _loss(u, w).backward()
                    opt.step()
                worst = max(worst, max_err(field.detach().full_tensor().to_local(), ref.detach()))
            errors[name] = worst
        return errors
    finally:
        DistributedManager.shutdown()


def test_optimizers_on_a_domain_leaf_step_as_one_process(ranks):
    for sizes in ((9,), (1, 8), (4, 0, 5)):
        for rank, errors in enumerate(ranks.run(len(sizes), _body, sizes, timeout=120)):
            assert all(err < 1e-12 for err in errors.values()), (sizes, rank, errors)
