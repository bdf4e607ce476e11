"""Learn one explicit heat-equation step with a CNN on a domain-sharded 2-D field, checked against one process.

Usage::

    torchrun --nproc-per-node 4 examples/domain_parallel_cnn.py            # 4 CPU ranks, uneven shards
    torchrun --nproc-per-node 2 examples/domain_parallel_cnn.py --steps 3 --height 24

Every rank holds the field's generator seed; each keeps only its rows (uneven sizes, e.g. 14/9/13/12
for height 48), the CNN runs unchanged on the shards, the loss is the one-process value on every
rank, and parameter gradients are summed over the domain. The same model is trained in one
process alongside (fp64) and the script exits non-zero if losses or parameters differ.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from mesh3d import DistributedManager, domain, get_logger


def heat_step(u: torch.Tensor, alpha: float = 0.2) -> torch.Tensor:
    """u + alpha * Laplacian(u), zero (Dirichlet) boundaries: the target the CNN learns."""
    lap = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]], dtype=u.dtype).view(1, 1, 3, 3)
    return u + alpha * F.conv2d(u, lap, padding=1)


def uneven_sizes(height: int, parts: int) -> tuple[int, ...]:
    """Deliberately uneven shard sizes that sum to ``height`` (first rank largest)."""
    base = [height // parts + (3 if i == 0 else (-2 if i == 1 else 0)) for i in range(parts)] if parts > 1 else [height]
    base[-1] += height - sum(base)
    return tuple(base)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--height", type=int, default=48)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()

    dm = DistributedManager.initialize(batch=1, domain=-1)
    log = get_logger("example.domain")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 16, 3, padding=2, dilation=2),
                          nn.GELU(), nn.Conv2d(16, 1, 3, padding=1)).double()
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=3e-3)
    u = torch.randn(4, 1, args.height, args.width, dtype=torch.float64).cumsum(2).cumsum(3) / 10
    target = heat_step(u)
    sizes = uneven_sizes(args.height, dm.axis_size("domain"))
    us, ts = domain.shard(u, dim=2, sizes=sizes), domain.shard(target, dim=2, sizes=sizes)

    worst = 0.0
    for step in range(args.steps):
        opt.zero_grad()
        loss = F.mse_loss(model(us), ts)
        loss.backward()
        for p in model.parameters():  # the domain gradient rule: sum over the domain group
            torch.distributed.all_reduce(p.grad, group=dm.group("domain"))
        opt.step()

        opt_ref.zero_grad()
        loss_ref = F.mse_loss(reference(u), target)
        loss_ref.backward()
        opt_ref.step()
        worst = max(worst, abs(float(loss.detach()) - float(loss_ref.detach())))
        if dm.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            log.info("step %d loss %.6e (one process %.6e)", step, float(loss.detach()), float(loss_ref.detach()))
    param_diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    ok = worst < 1e-9 and param_diff < 1e-9
    if dm.rank == 0:
        print(f"domain={dm.axis_size('domain')} sizes={sizes} max|loss diff|={worst:.2e} "
              f"max|param diff|={param_diff:.2e} {'MATCHES one process' if ok else 'DIFFERS from one process'}")
    DistributedManager.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
