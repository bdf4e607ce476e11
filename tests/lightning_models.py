"""LightningModules shared by the Lightning strategy tests (imported on every rank and in the test process).

Both modules read their data from deterministic tensors and size the per-rank batch from the
batch axis, so one process with the global batch and any mesh see the same samples per step.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mesh3d import DistributedManager, Plan

from parallel_models import SEQ, VOCAB, Transformer, full_params, transformer_plan_model

GLOBAL_BATCH, SAMPLES, LR = 4, 12, 3e-3  # 3 optimizer steps per epoch
FIELD_H, FIELD_W, CHANNELS = 15, 6, 2     # 15 rows: uneven shards (8, 7) over two domain ranks


def batch_replicas() -> int:
    """How many batch-axis ranks share the global batch (1 in a plain one-process fit)."""
    return DistributedManager().axis_size("batch") if DistributedManager.is_initialized() else 1


class Recorder(pl.Callback):
    """Keeps every training step's global-batch loss: each rank's loss averaged over the batch axis.

    ``trainer.strategy.reduce`` defaults to the batch axis under MeshStrategy (and is the identity in
    one process), so on every rank of any mesh this is the one-process loss of the same step.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")))


class _Base(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.log_sync = False  # tests switch on self.log(..., sync_dist=True) to check the reduction

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        data = self.dataset()
        if DistributedManager.is_initialized():
            # Lightning swaps in a DistributedSampler over the batch axis, shuffling (seed 0, epoch).
            return DataLoader(data, batch_size=GLOBAL_BATCH // batch_replicas(), shuffle=True)
        # One process: the same permutation, whole, so step k sees the union of the ranks' step-k samples.
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)

    def val_dataloader(self):
        # Lightning gives evaluation loaders a non-shuffling DistributedSampler over the batch axis.
        return DataLoader(self.dataset(), batch_size=GLOBAL_BATCH // batch_replicas())

    def validation_step(self, batch, batch_idx):
        loss = self.step_loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.step_loss(batch)
        self.log("loss", loss, sync_dist=self.log_sync)
        return loss

    def full_state(self) -> dict[str, torch.Tensor]:
        return full_params(self)


class LitTransformer(_Base):
    """The parallelize tests' transformer (embedding, attention, MLP, LayerNorm, head) as a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Transformer()

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def step_loss(self, batch):
        tokens, targets = batch
        # (B, vocab, T) logits: the sequence dim stays a dim of its own, so it can be domain-sharded.
        return F.cross_entropy(self.net(tokens).transpose(1, 2), targets)


def transformer_plan(batch: str | None = "fsdp") -> Plan:
    """The transformer's tensor-parallel plan, its globs prefixed by the LightningModule attribute."""
    return Plan(model={f"net.{k}": v for k, v in transformer_plan_model().items()}, batch=batch)


class FieldBlock(nn.Module):
    """Depthwise conv (halo exchange), GroupNorm (global statistics) and a channel MLP (tensor parallel)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.mix = nn.Conv2d(width, width, 3, padding=1, groups=width, padding_mode="circular")
        self.norm = nn.GroupNorm(2, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        h = self.norm(self.mix(x)).permute(0, 2, 3, 1)
        return x + self.down(F.gelu(self.up(h))).permute(0, 3, 1, 2)


class LitField(_Base):
    """A CNN on 2-D fields whose rows are split over the domain axis (``MeshStrategy(domain_dims=(2, 2))``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(CHANNELS, 8, 3, padding=1, padding_mode="circular")
        self.blocks = nn.ModuleList(FieldBlock(8, 16) for _ in range(2))
        self.head = nn.Conv2d(8, CHANNELS, 1)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return x + self.head(h)

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(SAMPLES, CHANNELS, FIELD_H, FIELD_W, generator=g)
        y = x + 0.1 * (torch.roll(x, 1, 2) + torch.roll(x, -1, 3) - 2 * x)  # one heat-equation step
        return TensorDataset(x, y)

    def step_loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)


def field_plan(batch: str | None = "fsdp") -> Plan:
    return Plan(model={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, batch=batch)


class LitFieldParallelizesItself(LitField):
    """Parallelizes itself in configure_model() (the strategy gets no plan), as Lightning users do by hand."""

    def configure_model(self) -> None:
        from mesh3d import parallelize

        if not getattr(self, "_mesh3d_parallelized", False):  # Lightning calls this hook on every fit/test
            parallelize(self, field_plan())


class LitFieldNotIdempotent(LitField):
    """configure_model() parallelizes unconditionally: the second trainer.fit() parallelizes it twice."""

    def configure_model(self) -> None:
        from mesh3d import parallelize

        parallelize(self, field_plan())


class LitFieldShardsItsOwnBatches(LitField):
    """Shards its batches in Lightning's on_after_batch_transfer hook (MeshStrategy gets no domain_dims)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        from mesh3d import domain

        x, y = batch
        if DistributedManager.is_initialized() and DistributedManager().axis_size("domain") > 1:
            sizes = (FIELD_H - 5, 5)  # any split works: here a deliberately lopsided one
            return domain.shard(x, dim=2, sizes=sizes), domain.shard(y, dim=2, sizes=sizes)
        return x, y
