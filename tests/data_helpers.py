"""Shared by the data tests (imported on every rank): a .npy field dataset, a small CNN, and a training loop
that records, per step, the global sample ids (read back from the batches themselves) and the global loss."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

N, C, H, W = 10, 2, 9, 5     # 9 rows: uneven slabs over 2 (5, 4) and 4 (3, 3, 3, 0) domain ranks
GLOBAL_BATCH, LR = 4, 0.02


def write_dataset(root: str) -> dict[str, str]:
    """x: random fields; y: one explicit diffusion step of x (what the net learns). fp64 .npy files."""
    g = np.random.default_rng(5)
    x = g.standard_normal((N, C, H, W))
    y = x + 0.1 * (np.roll(x, 1, 2) + np.roll(x, -1, 3) - 2 * x)
    paths = {"x": os.path.join(root, "x.npy"), "y": os.path.join(root, "y.npy")}
    np.save(paths["x"], x)
    np.save(paths["y"], y)
    return paths


def field_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(C, 6, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                         nn.Conv2d(6, C, 3, padding=1)).double()


def batch_axis() -> tuple[int, object]:
    from mesh3d import DistributedManager

    if DistributedManager.is_initialized():
        dm = DistributedManager()
        return dm.axis_size("batch"), dm.group("batch")
    return 1, None


def global_ids(local: torch.Tensor) -> list[int]:
    """The global batch's sample ids from every batch rank's local ids (rank b holds positions b, b+B, ...)."""
    ranks, group = batch_axis()
    if ranks == 1:
        return local.tolist()
    parts = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.stack(parts, dim=1).reshape(-1).tolist()


def global_loss(loss) -> float:
    value = loss.detach()
    value = value.to_local() if hasattr(value, "to_local") else value
    ranks, group = batch_axis()
    if ranks > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= ranks
    return float(value)


def train(model, opt, loader, dataset, steps: int) -> list[tuple[list[int], float]]:
    """``steps`` optimizer steps (across epochs); per step (global sample ids, global loss)."""
    done: list[tuple[list[int], float]] = []
    while len(done) < steps:
        for batch in loader:
            batch = dataset.to_domain(batch)
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            ids = global_ids(batch["index"])
            assert ids == list(loader.last_batch.global_ids), (ids, loader.last_batch)
            done.append((ids, global_loss(loss)))
            if len(done) == steps:
                break
    return done
