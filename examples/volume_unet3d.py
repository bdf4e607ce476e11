"""A 3-D U-Net on volumes split along depth over the domain axis, HSDP over batch, checked against one process.

Usage::

    torchrun --nproc-per-node 4 examples/volume_unet3d.py                  # mesh (batch 2, domain 2, model 1)
    torchrun --nproc-per-node 4 examples/volume_unet3d.py --batch 1        # all 4 ranks split each volume
    torchrun --nproc-per-node 8 examples/volume_unet3d.py --steps 5 --depth 40

The kind of model 3-D scientific data needs (CT/MRI segmentation, porous media, 3-D CFD fields):
each volume is too big for one device, so every sample's *depth* is split over the domain ranks
(unevenly: the first rank gets 3 extra slices) while the batch axis runs HSDP. The network uses
Conv3d (strided, dilated), GroupNorm, 3-D max pooling, trilinear upsampling and a skip
connection, all unchanged PyTorch modules. ``parallelize`` gives gradients averaged over batch
and summed over domain; the same network trained in one process on the whole batch (fp64) must
end with the same loss and parameters, else the script exits non-zero.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mesh3d import DistributedManager, Plan, domain, parallelize


class UNet3d(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(1, width, 3, padding=1), nn.GroupNorm(2, width), nn.SiLU())
        self.down = nn.Sequential(nn.Conv3d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(2, 2 * width),
                                  nn.SiLU(), nn.Conv3d(2 * width, 2 * width, 3, padding=2, dilation=2), nn.SiLU())
        self.pool = nn.Sequential(nn.MaxPool3d(2), nn.Conv3d(width, 2 * width, 1))
        self.up = nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
        self.dec = nn.Sequential(nn.Conv3d(3 * width, width, 3, padding=1), nn.SiLU(), nn.Conv3d(width, 2, 1))

    def forward(self, x):
        e = self.enc(x)
        m = self.down(e) + self.pool(e)                          # two ways down, same half resolution
        return self.dec(torch.cat([e, self.up(m)], dim=1))     # 2-class logits per voxel


#: HSDP: each batch index's domain ranks shard the weights, the batch axis replicates them (docs/plan.md).
HSDP = Plan(batch="hsdp")


def unet3d_wide() -> UNet3d:
    """The same network, 32 features wide (``mesh3d plan examples/volume_unet3d.py:unet3d_wide ...``, docs/plan.md)."""
    return UNet3d(width=32)


def volumes(n: int, depth: int, side: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy volumes with a few bright spheres; labels mark the voxels inside a sphere."""
    g = torch.Generator().manual_seed(seed)
    z, y, x = torch.meshgrid(*(torch.linspace(-1, 1, s, dtype=torch.float64) for s in (depth, side, side)), indexing="ij")
    labels = torch.zeros(n, depth, side, side, dtype=torch.int64)
    for i in range(n):
        for c, r in zip(torch.rand(3, 3, generator=g, dtype=torch.float64) * 1.4 - 0.7,
                        torch.rand(3, generator=g, dtype=torch.float64) * 0.3 + 0.2):
            labels[i] |= (((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2) < r ** 2).long()
    images = labels.double() + 0.5 * torch.randn(n, depth, side, side, generator=g, dtype=torch.float64)
    return images.unsqueeze(1), labels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=-1, help="batch axis size (-1: whatever the domain leaves)")
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=20, help="volume depth (split over the domain)")
    parser.add_argument("--side", type=int, default=12)
    args = parser.parse_args()

    dm = DistributedManager.initialize(batch=args.batch, domain=args.domain, model=1)
    nb, b, nd = dm.axis_size("batch"), dm.axis_rank("batch"), dm.axis_size("domain")
    torch.manual_seed(0)
    reference = UNet3d().double()
    model = parallelize(copy.deepcopy(reference), Plan(batch="hsdp" if nb > 1 else "fsdp"))
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, reference))
    sizes = None
    if nd > 1:  # uneven on purpose: the first rank gets 3 extra slices
        sizes = [(args.depth - 3) // nd] * nd
        sizes[0] += args.depth - sum(sizes)
    per_rank = 2
    worst = 0.0
    for step in range(args.steps):
        x, y = volumes(nb * per_rank, args.depth, args.side, seed=step)
        mine = slice(b * per_rank, (b + 1) * per_rank)
        xs = domain.shard(x[mine], dim=2, sizes=sizes)            # (N, C, D, H, W): split depth
        ys = domain.shard(y[mine], dim=1, sizes=sizes)            # (N, D, H, W) class labels
        loss = F.cross_entropy(model(xs), ys)                      # the voxel mean of this batch rank's volumes
        loss.backward()
        opt.step()
        opt.zero_grad()
        shown = loss.detach().to_local().clone()
        dist.all_reduce(shown, group=dm.group("batch"))
        shown /= nb

        loss_ref = F.cross_entropy(reference(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss_ref = loss_ref.item()
        worst = max(worst, abs(float(shown) - loss_ref))
        if dm.rank == 0:
            print(f"step {step} loss {float(shown):.8f} one-process {loss_ref:.8f}", flush=True)
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        diffs = [(p.full_tensor() if isinstance(p, DTensor) else p) - q for p, q in zip(model.parameters(), reference.parameters())]
    param_diff = max(float(d.abs().max()) for d in diffs)
    ok = worst < 1e-9 and param_diff < 1e-9   # fp64: only summation order differs
    if dm.rank == 0:
        print(f"mesh {dm.shape} depth split {sizes}: max|loss diff| {worst:.1e}, max|param diff| {param_diff:.1e}: "
              f"{'MATCHES one process' if ok else 'DIFFERS from one process'}")
    DistributedManager.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
