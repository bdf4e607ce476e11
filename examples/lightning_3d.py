"""A LightningModule trained with mesh3d's ``MeshStrategy``, checked against the same module in one process.

The module is a small CNN on 2-D fields (one explicit heat-equation step, a toy weather/CFD
surrogate). On the mesh its batches follow the ``batch`` axis, each field's rows are split unevenly
over the ``domain`` axis (``domain_dims``: halo-exchanging convs, GroupNorm over the whole field),
and its channel MLP is tensor-parallel over the ``model`` axis — all from one ``Plan``. The module
itself is plain Lightning: no process groups, wrappers or ``configure_model``.

Two phases, each started as Lightning users start jobs (plain ``python``: Lightning's own launcher
starts the other processes; ``torchrun`` or ``srun`` work too)::

    python examples/lightning_3d.py fit    --devices 4 --mesh 1,2,2 --ckpt runs/lightning/epoch1.ckpt
    python examples/lightning_3d.py resume --devices 4 --mesh 2,1,2 --ckpt runs/lightning/epoch1.ckpt

``fit`` trains one epoch and saves with ``trainer.save_checkpoint``; ``resume`` continues on a mesh of
another shape with ``trainer.fit(..., ckpt_path=...)``. Each prints its losses beside the one-process
run's and exits non-zero if the parameters differ from it.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _runs import fresh_output, whole
from mesh3d import DistributedManager, Plan
from mesh3d.lightning import MeshStrategy

GLOBAL_BATCH, SAMPLES, ROWS, COLS, CHANNELS, LR = 4, 16, 21, 8, 2, 3e-3
#: fp64 (``precision="64-true"``): the parallel run differs from one process only in summation order.
RTOL = 1e-9
PLAN = Plan(batch="fsdp", model={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"})


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.mix = nn.Conv2d(width, width, 5, padding=2, groups=width, padding_mode="circular")
        self.norm = nn.GroupNorm(2, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        h = self.norm(self.mix(x)).permute(0, 2, 3, 1)  # channels-last: the MLP mixes channels
        return x + self.down(F.gelu(self.up(h))).permute(0, 3, 1, 2)


class HeatModule(pl.LightningModule):
    def __init__(self, width: int = 8, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process and in the reference
        self.stem = nn.Conv2d(CHANNELS, width, 3, padding=1, padding_mode="circular")
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(2))
        self.head = nn.Conv2d(width, CHANNELS, 1)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return x + self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch                                  # domain tensors under MeshStrategy(domain_dims=...)
        loss = F.mse_loss(self(x), y)                 # the one-process loss of this rank's samples
        self.log("train_loss", loss, sync_dist=True)  # averaged over the batch axis only
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        data = fields()
        if DistributedManager.is_initialized():
            replicas = DistributedManager().axis_size("batch")
            return DataLoader(data, batch_size=GLOBAL_BATCH // replicas, shuffle=True)  # sampler: batch axis
        # The one-process reference: the permutation Lightning's DistributedSampler uses, whole.
        return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0))


def fields() -> TensorDataset:
    """Smooth random periodic fields and their state after one explicit heat-equation step."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, CHANNELS, ROWS, COLS, generator=g)
    for _ in range(3):
        x = (x + torch.roll(x, 1, 2) + torch.roll(x, 1, 3)) / 3
    lap = torch.roll(x, 1, 2) + torch.roll(x, -1, 2) + torch.roll(x, 1, 3) + torch.roll(x, -1, 3) - 4 * x
    return TensorDataset(x, x + 0.2 * lap)


class LossLog(pl.Callback):
    """Every step's global-batch loss (the rank losses averaged over the batch axis)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")))


def trainer_for(epochs: int, log: LossLog, strategy: MeshStrategy | None = None, devices: int = 1) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy or "auto", precision="64-true",
                      max_epochs=epochs, callbacks=[log], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)


def one_process(epochs: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    module, log = HeatModule(), LossLog()
    trainer_for(epochs, log).fit(module)
    return log.losses, {k: v.detach().clone() for k, v in module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["fit", "resume"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--mesh", default="1,2,2", help="batch,domain,model sizes (one may be -1)")
    parser.add_argument("--ckpt", default="runs/lightning/epoch1.ckpt")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.mesh.split(","))

    # Only the first process computes the reference (Lightning's launcher re-runs this script for the others).
    first = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0
    epochs = 1 if args.phase == "fit" else 2
    reference = one_process(epochs) if first else None

    strategy = MeshStrategy(*shape, plan=PLAN, domain_dims=(2, 2))  # split rows (dim 2) of x and y
    module, log = HeatModule(), LossLog()
    trainer = trainer_for(epochs, log, strategy, args.devices)
    if args.phase == "fit":
        if first:  # a rerun starts afresh (checkpoints are never overwritten); the other processes write after collectives
            fresh_output(os.path.dirname(os.path.abspath(args.ckpt)), "examples/lightning_3d.py", [os.path.basename(args.ckpt)])
        trainer.fit(module)
        trainer.save_checkpoint(args.ckpt, weights_only=False)  # a directory: sharded safetensors + JSON (trainer state included)
    else:
        trainer.fit(module, ckpt_path=args.ckpt)  # saved on another mesh: resharded on load
    full = {k: whole(v) for k, v in module.named_parameters()}  # a collective on every rank
    if not trainer.is_global_zero:
        return

    ref_losses, ref_params = reference
    ref_losses = ref_losses[-len(log.losses):]  # resume: the second epoch only
    dm = DistributedManager()
    launched_by = type(trainer.strategy.cluster_environment).__name__
    print(f"{args.phase}: mesh {dm.shape} on {dm.world_size} processes ({launched_by}), "
          f"global step {trainer.global_step}, epoch {trainer.current_epoch}")
    for step, (mine, ref) in enumerate(zip(log.losses, ref_losses)):
        print(f"  step {step} loss {mine:.10f} one-process {ref:.10f}")
    worst = max(float((full[k] - ref_params[k]).abs().max() / ref_params[k].abs().max()) for k in ref_params)
    same = worst < RTOL and torch.allclose(torch.tensor(log.losses), torch.tensor(ref_losses), rtol=RTOL)
    print(f"parameters vs one process: max relative diff {worst:.2e}: {'MATCHES' if same else 'DIFFERS FROM'} one process")
    if args.phase == "fit":
        print(f"checkpoint: {args.ckpt} ({', '.join(sorted(os.listdir(args.ckpt)))})")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
