"""A physics-informed network for the heat equation on a domain-sharded space-time grid, checked against one process.

Usage::

    torchrun --nproc-per-node 4 examples/pinn_heat.py                     # (batch 1, domain 2x2): blocks of (x, y)
    torchrun --nproc-per-node 3 examples/pinn_heat.py --layout slabs      # 3 uneven slabs of x

The network maps the coordinates (t, x, y) of every collocation point to u (an MLP written as 1x1x1 convolutions,
as PINNs on grids are). Its loss is the residual of u_t = alpha (u_xx + u_yy), with the derivatives taken by
``torch.autograd.grad`` with respect to the coordinate field (``create_graph=True``, twice for the second
derivatives), plus the initial condition u(0, x, y) = sin(pi x) sin(pi y) and u = 0 on the boundary. The
coordinate field is a domain tensor (each rank holds its block of the grid); the derivatives come back as domain
tensors laid out like it, the means are global, and parameter gradients are summed over the domain by hand. The same
network trains in one process alongside (fp64); the script exits non-zero unless every step's loss and the final
parameters equal it.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from mesh3d import DistributedManager, domain

ALPHA = 0.1


def coordinates(steps: int, points: int) -> torch.Tensor:
    """The collocation grid as a (1, 3, T, X, Y) field of (t, x, y): t in [0, 0.5], x and y in [0, 1]."""
    t = torch.linspace(0.0, 0.5, steps, dtype=torch.float64)
    x = torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(t, x, x, indexing="ij"))
    return grid.unsqueeze(0)


def masks(steps: int, points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain masks of the global grid: the initial time (1, 1, T, 1, 1) and the spatial boundary (1, 1, 1, X, Y)."""
    initial = torch.zeros(1, 1, steps, 1, 1, dtype=torch.float64)
    initial[:, :, 0] = 1.0
    boundary = torch.ones(1, 1, 1, points, points, dtype=torch.float64)
    boundary[..., 1:-1, 1:-1] = 0.0
    return initial, boundary


def network(width: int = 24) -> nn.Module:
    """An MLP over each point's (t, x, y), as 1x1x1 convolutions of the coordinate field."""
    return nn.Sequential(nn.Conv3d(3, width, 1), nn.Tanh(), nn.Conv3d(width, width, 1), nn.Tanh(),
                         nn.Conv3d(width, 1, 1)).double()


def pinn_loss(model: nn.Module, coords: torch.Tensor, initial: torch.Tensor, boundary: torch.Tensor) -> torch.Tensor:
    """Mean squared PDE residual + initial and boundary losses. ``coords`` requires grad (plain or a domain tensor)."""
    u = model(coords)
    pick = torch.eye(3, dtype=coords.dtype).view(3, 1, 3, 1, 1, 1)  # pick[i]: channel i of a (1, 3, ...) field
    (du,) = torch.autograd.grad(u.sum(), coords, create_graph=True)           # (u_t, u_x, u_y) at every point
    (dux,) = torch.autograd.grad(du, coords, grad_outputs=torch.ones_like(du) * pick[1], create_graph=True)
    (duy,) = torch.autograd.grad(du, coords, grad_outputs=torch.ones_like(du) * pick[2], create_graph=True)
    u_t = (du * pick[0]).sum(1, keepdim=True)
    laplacian = (dux * pick[1]).sum(1, keepdim=True) + (duy * pick[2]).sum(1, keepdim=True)
    residual = (u_t - ALPHA * laplacian) * (1 - initial)
    x, y = (coords * pick[1]).sum(1, keepdim=True), (coords * pick[2]).sum(1, keepdim=True)
    u0 = torch.sin(math.pi * x) * torch.sin(math.pi * y)
    ic = (initial * (u - u0) ** 2).sum() / (initial * torch.ones_like(u)).sum()
    bc = (boundary * u ** 2).sum() / (boundary * torch.ones_like(u)).sum()
    return (residual ** 2).mean() + ic + bc


def train(layout: str, steps: int, grid: tuple[int, int], sizes: tuple | None = None,
          seed: int = 0) -> tuple[list[float], list[float], float]:
    """Train on this mesh and in one process alongside: (losses, one-process losses, largest parameter difference).

    ``layout``: "blocks" (x and y split over a 2-D domain grid) or "slabs" (x split); ``sizes``: the split (default
    ``torch.chunk``'s).
    """
    torch.manual_seed(seed)
    model = network()
    reference = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
    coords = coordinates(*grid)
    initial, boundary = masks(*grid)
    dm = DistributedManager()
    xs = domain.shard(coords, dims=(3, 4), sizes=sizes) if layout == "blocks" else domain.shard(coords, 3, sizes)
    xs.requires_grad_()
    coords.requires_grad_()
    losses, losses_ref = [], []
    for _ in range(steps):
        for m, o, c, out in ((model, opt, xs, losses), (reference, opt_ref, coords, losses_ref)):
            o.zero_grad()
            loss = pinn_loss(m, c, initial, boundary)
            loss.backward()
            if m is model:
                for p in m.parameters():  # the domain gradient rule, by hand (parallelize does it for you)
                    dist.all_reduce(p.grad, group=dm.group("domain"))
                loss = loss.to_local()
            o.step()
            out.append(float(loss.detach()))
    worst = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    return losses, losses_ref, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("blocks", "slabs"), default="blocks")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--times", type=int, default=5)
    parser.add_argument("--points", type=int, default=11)
    args = parser.parse_args()
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    if args.layout == "blocks" and world != 4:
        parser.error("--layout blocks runs on 4 ranks (a 2x2 grid of x and y); use --layout slabs otherwise")
    dm = DistributedManager.initialize(batch=1, domain=(2, 2) if args.layout == "blocks" else -1)
    losses, losses_ref, worst = train(args.layout, args.steps, (args.times, args.points))
    equal = all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(losses, losses_ref)) and worst < 1e-9
    if dm.rank == 0:
        for step, (a, b) in enumerate(zip(losses, losses_ref)):
            print(f"step {step} loss {a:.10f} one-process {b:.10f}")
        print(f"{args.layout} on {dm.axis_size('domain')} ranks: every step's loss and the parameters (max abs diff "
              f"{worst:.2e}) {'MATCH one process' if equal else 'DIFFER from one process'}")
    DistributedManager().shutdown()
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
