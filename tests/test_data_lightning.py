"""MeshStrategy with a MeshDataLoader: a fit resumed mid-epoch on another mesh equals the uninterrupted fit.

Every step's global sample ids (read back from the batches) and loss are compared with one
uninterrupted fit in this process, in fp64.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from mesh3d import DistributedManager, Plan
from mesh3d.data import MeshDataLoader, MeshSampler, SlabDataset

import data_helpers as dh
import lightning_models as lm


class LitSlabs(pl.LightningModule):
    """The data tests' CNN; each domain rank reads only its rows of every sample from the .npy files."""

    def __init__(self, paths: dict[str, str], batch_ranks: int | None = None) -> None:
        super().__init__()
        self.net, self.paths, self.batch_ranks, self.ids = dh.field_net(), paths, batch_ranks, []

    def train_dataloader(self):
        self.ds = SlabDataset(self.paths, dim=2)
        extra = {} if self.batch_ranks is None else {"batch_ranks": self.batch_ranks, "batch_rank": 0}
        return MeshDataLoader(self.ds, MeshSampler(len(self.ds), dh.GLOBAL_BATCH, seed=3, **extra))

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return self.ds.to_domain(batch) if DistributedManager.is_initialized() else batch

    def training_step(self, batch, batch_idx):
        self.ids.append(dh.global_ids(batch["index"]))
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=dh.LR)


def _trainer(shape, steps, recorder) -> pl.Trainer:
    kwargs = dict(accelerator="cpu", precision="64-true", max_steps=steps, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[recorder])
    if shape is None:
        return pl.Trainer(devices=1, **kwargs)
    from mesh3d.lightning import MeshStrategy

    return pl.Trainer(devices=torch.distributed.get_world_size(), strategy=MeshStrategy(*shape, plan=Plan(batch="fsdp")),
                      **kwargs)


def _fit(shape, paths, steps, save=None, resume=None):
    module, recorder = LitSlabs(paths), lm.Recorder()
    trainer = _trainer(shape, steps, recorder)
    trainer.fit(module, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    return module.ids, recorder.losses, trainer.global_step, trainer.current_epoch


@pytest.mark.parametrize("shape_a, shape_b", [((2, 2, 1), (1, 4, 1)), ((1, 4, 1), (4, 1, 1))])
def test_resume_mid_epoch_on_another_mesh_equals_uninterrupted_fit(ranks, tmp_path, shape_a, shape_b):
    paths = dh.write_dataset(str(tmp_path))
    k, total = 3, 7  # 2 steps per epoch: saved after step 1 of epoch 1, resumed through epochs 1-3
    want_ids, want_losses, _, _ = _fit(None, paths, total)
    path = str(tmp_path / "mid.ckpt")
    for ids, losses, step, epoch in ranks.run(4, _fit, shape_a, paths, k, path):
        assert (ids, step) == (want_ids[:k], k)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses[:k]), rtol=1e-10, atol=1e-12)
    for ids, losses, step, _ in ranks.run(4, _fit, shape_b, paths, total, None, path):
        assert ids == want_ids[k:] and step == total
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses[k:]), rtol=1e-10, atol=1e-12)


def _wrong_split_body(paths):
    module = LitSlabs(paths, batch_ranks=1)
    try:
        _trainer((2, 2, 1), 1, lm.Recorder()).fit(module)
    except ValueError as err:
        return str(err)
    return None


def test_a_mesh_sampler_split_over_other_batch_ranks_is_refused(ranks, tmp_path):
    paths = dh.write_dataset(str(tmp_path))
    for message in ranks.run(4, _wrong_split_body, paths):
        assert message and "split over 1 batch ranks" in message and "batch axis has 2 ranks" in message
