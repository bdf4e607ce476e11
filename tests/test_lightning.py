"""MeshStrategy: LightningModules fit on 4 pooled ranks equal the same module fit in one process.

fp64 throughout (``precision="64-true"``): AdamW amplifies summation-order noise in fp32 (see
docs/limitations.md), and in fp64 the parallel run must agree with one process to ~1e-10.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch

import lightning_models as lm

RTOL, ATOL = 1e-9, 1e-11
MODULES = {"transformer": (lm.LitTransformer, lm.transformer_plan, (1, 1)),
           "field": (lm.LitField, lm.field_plan, (2, 2))}


def _trainer(strategy=None, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", precision="64-true", max_epochs=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    if strategy is None:
        defaults["devices"] = 1
    else:
        defaults.update(devices=torch.distributed.get_world_size(), strategy=strategy)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _strategy(kind: str, shape, batch_mode: str | None = "fsdp", **kwargs):
    from mesh3d.lightning import MeshStrategy

    _, plan, dims = MODULES[kind]
    return MeshStrategy(*shape, plan=plan(batch_mode), domain_dims=dims, **kwargs)


def _fit_reference(kind: str, epochs: int = 1):
    module, recorder = MODULES[kind][0](), lm.Recorder()
    _trainer(max_epochs=epochs, callbacks=[recorder]).fit(module)
    return recorder.losses, {k: v.clone() for k, v in module.full_state().items()}


def _assert_same(losses, params, ref_losses, ref_params) -> None:
    assert len(losses) == len(ref_losses) and len(losses) >= 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


def _fit_body(kind: str, shape, batch_mode: str | None):
    module, recorder = MODULES[kind][0](), lm.Recorder()
    _trainer(_strategy(kind, shape, batch_mode), callbacks=[recorder]).fit(module)
    return recorder.losses, module.full_state()


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2), (4, 1, 1)])
def test_fit_equals_one_process(ranks, kind, shape):
    ref_losses, ref_params = _fit_reference(kind)
    for losses, params in ranks.run(4, _fit_body, kind, shape, "fsdp"):
        _assert_same(losses, params, ref_losses, ref_params)


def _fit_compiled_body(kind: str, shape):
    from dataclasses import replace

    from torch._dynamo.utils import counters

    from mesh3d.lightning import MeshStrategy

    make, plan, dims = MODULES[kind]
    module, recorder = make(), lm.Recorder()
    counters.clear()
    strategy = MeshStrategy(*shape, plan=replace(plan("fsdp"), compile={"backend": "aot_eager"}), domain_dims=dims)
    _trainer(strategy, callbacks=[recorder]).fit(module)
    return recorder.losses, module.full_state(), counters["stats"]["unique_graphs"]


def test_fit_with_compiled_blocks_equals_one_process(ranks):
    """``MeshStrategy(plan=Plan(compile=...))`` passes compile through ``parallelize``: the field model's blocks
    (a circular depthwise conv with halos, GroupNorm, a colwise/rowwise MLP) compile, on FSDP x domain x TP."""
    ref_losses, ref_params = _fit_reference("field")
    for losses, params, graphs in ranks.run(4, _fit_compiled_body, "field", (1, 2, 2), timeout=300):
        _assert_same(losses, params, ref_losses, ref_params)
        assert graphs > 0


def _fit_hsdp_ddp_body(shape):
    out = {}
    for mode in ("hsdp", "ddp"):
        module, recorder = lm.LitField(), lm.Recorder()
        _trainer(_strategy("field", shape, mode), callbacks=[recorder]).fit(module)
        out[mode] = (recorder.losses, module.full_state())
    return out


def test_fit_hsdp_and_ddp_equal_one_process(ranks):
    ref_losses, ref_params = _fit_reference("field")
    for per_mode in ranks.run(4, _fit_hsdp_ddp_body, (2, 2, 1)):
        for losses, params in per_mode.values():
            _assert_same(losses, params, ref_losses, ref_params)


def _configure_model_body(shape):
    from mesh3d.lightning import MeshStrategy

    module, recorder = lm.LitFieldParallelizesItself(), lm.Recorder()
    trainer = _trainer(MeshStrategy(*shape, domain_dims=(2, 2)), callbacks=[recorder])
    trainer.fit(module)
    assert isinstance(module.device_mesh, torch.distributed.device_mesh.DeviceMesh)
    assert module.device_mesh.mesh_dim_names == ("batch", "domain", "model")
    return recorder.losses, module.full_state()


def test_module_parallelizing_itself_in_configure_model(ranks):
    ref_losses, ref_params = _fit_reference("field")
    for losses, params in ranks.run(4, _configure_model_body, (1, 2, 2)):
        _assert_same(losses, params, ref_losses, ref_params)


def _clip_body(shape):
    module, recorder = lm.LitTransformer(), lm.Recorder()
    _trainer(_strategy("transformer", shape), callbacks=[recorder], gradient_clip_val=0.05).fit(module)
    return recorder.losses, module.full_state()


def test_gradient_clipping_over_mixed_meshes(ranks):
    """Lightning's gradient_clip_val on FSDP x TP DTensors (torch's clip_grad_norm_ refuses mixed meshes)."""
    module, recorder = lm.LitTransformer(), lm.Recorder()
    _trainer(callbacks=[recorder], gradient_clip_val=0.05).fit(module)
    ref_params = module.full_state()
    unclipped = _fit_reference("transformer")[1]
    assert any(not torch.allclose(ref_params[k], unclipped[k]) for k in ref_params)  # clipping bit
    for losses, params in ranks.run(4, _clip_body, (2, 1, 2)):
        _assert_same(losses, params, recorder.losses, ref_params)


def _resume_save_body(kind, shape, path):
    module = MODULES[kind][0]()
    trainer = _trainer(_strategy(kind, shape))
    trainer.fit(module)
    trainer.save_checkpoint(path)
    return sorted(os.listdir(path))


def _resume_load_body(kind, shape, path):
    module, recorder = MODULES[kind][0](), lm.Recorder()
    trainer = _trainer(_strategy(kind, shape), max_epochs=2, callbacks=[recorder])
    trainer.fit(module, ckpt_path=path)
    return recorder.losses, module.full_state(), trainer.global_step, trainer.current_epoch


@pytest.mark.parametrize("kind, save_shape, load_shape", [
    ("transformer", (2, 1, 2), (1, 2, 2)),
    ("field", (1, 2, 2), (4, 1, 1)),
    ("field", (4, 1, 1), (2, 1, 2)),
])
def test_resume_on_another_mesh_equals_uninterrupted_fit(ranks, tmp_path, kind, save_shape, load_shape):
    ref_losses, ref_params = _fit_reference(kind, epochs=2)
    path = str(tmp_path / "epoch0.ckpt")
    files = ranks.run(4, _resume_save_body, kind, save_shape, path)[0]
    assert "index.json" in files and not any(f.endswith((".pt", ".pkl", ".ckpt")) for f in files)
    for losses, params, step, epoch in ranks.run(4, _resume_load_body, kind, load_shape, path):
        assert (step, epoch) == (6, 2)
        _assert_same(losses, params, ref_losses[3:], ref_params)


def _model_checkpoint_body(dirpath):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=dirpath, monitor="loss", save_top_k=1, save_last=True, every_n_train_steps=1)
    module = lm.LitField()
    module.log_sync = True
    trainer = _trainer(_strategy("field", (2, 2, 1)), enable_checkpointing=True, callbacks=[callback])
    trainer.fit(module)
    return sorted(os.listdir(dirpath)), callback.best_model_path, float(callback.best_model_score)


def _last_checkpoint_body(path):
    module = lm.LitField()
    trainer = _trainer(_strategy("field", (1, 1, 4)), max_epochs=2)
    trainer.fit(module, ckpt_path=path)
    return trainer.global_step


def test_model_checkpoint_callback_overwrites_last_and_prunes_top_k(ranks, tmp_path):
    """ModelCheckpoint rewrites last.ckpt every step and deletes all but the best: both go through mesh3d."""
    dirpath = str(tmp_path / "ckpts")
    listing, best, score = ranks.run(4, _model_checkpoint_body, dirpath)[0]
    assert "last.ckpt" in listing and len(listing) == 2, listing  # last + the single best; no leftovers
    assert os.path.basename(best) in listing and score > 0
    from mesh3d.checkpoint import read_index, verify

    assert read_index(os.path.join(dirpath, "last.ckpt"))["step"] == 3
    verify(os.path.join(dirpath, "last.ckpt"))
    assert ranks.run(4, _last_checkpoint_body, os.path.join(dirpath, "last.ckpt")) == [6] * 4


def _collectives_body():
    """Logged metrics and gathers follow the batch axis; barrier/broadcast/decisions span every rank."""
    from mesh3d import DistributedManager
    from mesh3d.lightning import MeshStrategy

    class Probe(lm.LitField):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            coords = DistributedManager().coordinates
            value = torch.tensor(float(coords["batch"] + 1), dtype=torch.float64)
            self.log("batch_sum", value, sync_dist=True, reduce_fx="sum")
            self.seen = {
                "gathered": self.all_gather(value).tolist(),
                "any": self.trainer.strategy.reduce_boolean_decision(coords["domain"] == 1, all=False),
                "all": self.trainer.strategy.reduce_boolean_decision(coords["domain"] == 1, all=True),
                "broadcast": self.trainer.strategy.broadcast(torch.distributed.get_rank(), src=3),
            }
            return loss

    module = Probe()
    trainer = _trainer(MeshStrategy(2, 2, 1, plan=lm.field_plan(), domain_dims=(2, 2)), max_steps=1)
    trainer.fit(module)
    return float(trainer.callback_metrics["batch_sum"]), module.seen


def test_metrics_and_collectives_follow_the_right_axes(ranks):
    for batch_sum, seen in ranks.run(4, _collectives_body):
        assert batch_sum == 1 + 2  # one value per batch index: not 2 * (1 + 2) from the domain peers
        assert seen == {"gathered": [1.0, 2.0], "any": True, "all": False, "broadcast": 3}


def _meta_init_body(shape):
    from mesh3d.lightning import MeshStrategy

    trainer = _trainer(MeshStrategy(*shape, plan=lm.transformer_plan(), seed=5), max_steps=1)
    with trainer.init_module(empty_init=True):
        module = lm.LitTransformer()
    assert all(p.is_meta for p in module.parameters())
    trainer.strategy.connect(module)  # what fit does first; then set up without training
    trainer.strategy.setup_environment()
    trainer.strategy._apply_plan(module)
    return module.full_state()


def test_meta_init_is_the_same_on_every_mesh(ranks):
    """Trainer.init_module(empty_init=True) + MeshStrategy(seed=...): bitwise the same weights on any mesh."""
    one = ranks.run(1, _meta_init_body, (1, 1, 1))[0]
    for shape in ((2, 1, 2), (1, 1, 4)):
        for state in ranks.run(4, _meta_init_body, shape):
            assert state.keys() == one.keys()
            for name in one:
                assert torch.equal(state[name], one[name]), (shape, name)


def _errors_body():
    from mesh3d.lightning import MeshStrategy

    messages = {}
    try:
        _trainer(MeshStrategy(batch=3, plan=lm.field_plan()))
    except ValueError as err:
        messages["sizes"] = str(err)
    try:
        _trainer(MeshStrategy(2, 1, 2, plan=lm.field_plan())).fit(lm.LitFieldParallelizesItself())
    except RuntimeError as err:
        messages["twice_plan"] = str(err)
    module = lm.LitFieldNotIdempotent()
    _trainer(MeshStrategy(2, 1, 2), max_steps=1).fit(module)
    try:
        _trainer(MeshStrategy(2, 1, 2), max_steps=2).fit(module)
    except RuntimeError as err:
        messages["twice_configure"] = str(err)
    try:
        _trainer(MeshStrategy(2, 1, 2)).fit(lm.LitField())
    except TypeError as err:
        messages["no_plan"] = str(err)
    return messages


def test_errors_raise_on_every_rank_before_hanging(ranks):
    for messages in ranks.run(4, _errors_body, timeout=60):
        assert "batch=3 does not divide world size 4" in messages["sizes"]
        assert "parallelized twice" in messages["twice_plan"] and "configure_model" in messages["twice_plan"]
        assert "already parallelized" in messages["twice_configure"]
        assert "plan=" in messages["no_plan"] and "configure_model" in messages["no_plan"]


def test_wrong_sizes_fail_when_the_trainer_is_built_before_any_process_starts():
    from mesh3d.lightning import MeshStrategy

    with pytest.raises(ValueError, match="model=3 does not divide world size 8"):
        pl.Trainer(accelerator="cpu", devices=8, strategy=MeshStrategy(batch=-1, model=3))
    with pytest.raises(ValueError, match="axis sizes are positive ints"):
        MeshStrategy(batch=0)
    with pytest.raises(TypeError, match="mesh3d.Plan"):
        MeshStrategy(plan={"net.up": "colwise"})
    with pytest.raises(TypeError, match="domain_dims"):
        MeshStrategy(domain_dims="x")


def _validate_body(kind, shape):
    module = MODULES[kind][0]()
    trainer = _trainer(_strategy(kind, shape))
    trainer.fit(module)
    (metrics,) = trainer.validate(module, verbose=False)
    return metrics["val_loss"]


@pytest.mark.parametrize("kind, shape", [("field", (2, 2, 1)), ("transformer", (1, 2, 2))])
def test_validate_after_fit_equals_one_process(ranks, kind, shape):
    module = MODULES[kind][0]()
    trainer = _trainer()
    trainer.fit(module)
    (expected,) = trainer.validate(module, verbose=False)
    for val_loss in ranks.run(4, _validate_body, kind, shape):
        assert val_loss == pytest.approx(expected["val_loss"], rel=RTOL)


def _mixed_precision_body(shape):
    from mesh3d.lightning import MeshStrategy

    plan = lm.field_plan()
    plan.param_dtype, plan.reduce_dtype = torch.bfloat16, torch.float32
    module, recorder = lm.LitField(), lm.Recorder()
    _trainer(MeshStrategy(*shape, plan=plan, domain_dims=(2, 2)), precision="32-true", callbacks=[recorder]).fit(module)
    return recorder.losses, {k: v.dtype for k, v in module.full_state().items()}


def test_fsdp_mixed_precision_from_the_plan(ranks):
    """Plan(param_dtype=bf16) under precision="32-true": bf16 compute, fp32 master weights, close to fp32."""
    module, recorder = lm.LitField(), lm.Recorder()
    _trainer(precision="32-true", callbacks=[recorder]).fit(module)
    for losses, dtypes in ranks.run(4, _mixed_precision_body, (1, 2, 2)):
        assert set(dtypes.values()) == {torch.float32}
        assert losses != recorder.losses  # bf16 compute really happened
        # bf16 has 8 bits of mantissa: ~0.4% per rounding; the losses stay within 3% of fp32's.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(recorder.losses), rtol=3e-2, atol=0)


def _own_sharding_body(shape):
    from mesh3d.lightning import MeshStrategy

    module, recorder = lm.LitFieldShardsItsOwnBatches(), lm.Recorder()
    _trainer(MeshStrategy(*shape, plan=lm.field_plan()), callbacks=[recorder]).fit(module)
    return recorder.losses, module.full_state()


def test_module_sharding_its_own_batches_in_on_after_batch_transfer(ranks):
    ref_losses, ref_params = _fit_reference("field")
    for losses, params in ranks.run(4, _own_sharding_body, (2, 2, 1)):
        _assert_same(losses, params, ref_losses, ref_params)


def _validate_from_checkpoint_body(shape, path):
    module = lm.LitField()
    (metrics,) = _trainer(_strategy("field", shape)).validate(module, ckpt_path=path, verbose=False)
    return metrics["val_loss"]


def test_validate_from_a_checkpoint_saved_on_another_mesh(ranks, tmp_path):
    """Weights only (no optimizer in validate), resharded from (4,1,1) onto (1,2,2)."""
    module = lm.LitField()
    trainer = _trainer()
    trainer.fit(module)
    (expected,) = trainer.validate(module, verbose=False)
    path = str(tmp_path / "fit.ckpt")
    ranks.run(4, _resume_save_body, "field", (4, 1, 1), path)
    for val_loss in ranks.run(4, _validate_from_checkpoint_body, (1, 2, 2), path):
        assert val_loss == pytest.approx(expected["val_loss"], rel=RTOL)


def test_inspect_summarizes_a_lightning_checkpoint(ranks, tmp_path):
    from mesh3d.checkpoint import describe

    path = str(tmp_path / "fit.ckpt")
    ranks.run(4, _resume_save_body, "field", (2, 2, 1), path)
    text = describe(path)
    assert "Lightning trainer state (epoch 1, global step 3; " in text and "mesh batch=2 x domain=2 x model=1" in text
    assert max(len(line) for line in text.splitlines()) < 300  # not kilobytes of loop state on one line


def _save_over_a_foreign_directory_body(path):
    trainer = _trainer(_strategy("field", (2, 1, 2)), max_steps=1)
    trainer.fit(lm.LitField())
    try:
        trainer.save_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused_on_every_rank(ranks, tmp_path):
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for message in ranks.run(4, _save_over_a_foreign_directory_body, str(foreign), timeout=60):
        assert message and "CheckpointError" in message and "not a mesh3d checkpoint" in message
    assert sorted(os.listdir(foreign)) == ["notes.txt"]
