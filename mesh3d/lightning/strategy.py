"""``MeshStrategy``: a Lightning Trainer strategy on mesh3d's (batch, domain, model) mesh.

The LightningModule owns its parallelization (Lightning issue #11922): either the strategy applies a
declarative ``Plan`` to it, or the module's ``configure_model()`` calls ``mesh3d.parallelize`` (or
``fully_shard``/``parallelize_module`` on ``self.device_mesh``) itself. The Trainer keeps what it is
good at: launching processes (its own launcher under plain ``python``, torchrun, SLURM), loops,
callbacks, logging. mesh3d adds what Lightning's ``ModelParallelStrategy`` lacks: a third (domain)
axis, HSDP and mixed precision from one plan, metrics reduced over the batch axis only, and
checkpoints that resume on any mesh with no pickle in them.

Usage::

    import lightning.pytorch as pl
    from mesh3d import Plan
    from mesh3d.lightning import MeshStrategy

    strategy = MeshStrategy(batch=2, domain=1, model=2, plan=Plan(model={"net.layers.*.up": "colwise"}))
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    trainer.fit(module)      # plain `python train.py`: Lightning starts the other 3 processes
"""

from __future__ import annotations

import atexit
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from mesh3d.grad import clip_grad_norm_
from mesh3d.lightning._lightning_private import (
    SubprocessScriptLauncher,
    all_gather_if_available,
    default_backend_for_device,
    init_dist_connection,
    set_module_device_mesh,
    sync_if_available,
)
from mesh3d.lightning.batches import DomainDims, check_domain_dims, plain_step_output, shard_batch
from mesh3d.data.sampler import MeshSampler, check_mesh_sampler
from mesh3d.lightning.checkpointing import load_lightning_checkpoint, remove_checkpoint, save_lightning_checkpoint
from mesh3d.group_settings import as_timeout
from mesh3d.manager import DistributedManager
from mesh3d.mesh_shape import resolve_mesh_shape
from mesh3d.parallel.apply import parallelize
from mesh3d.parallel.plan import Plan
from mesh3d.parallel.validate import already_parallel
from mesh3d.meta_builds import built_on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshStrategy"]

#: LightningModule methods that run the model: FSDP must all-gather parameters around them too,
#: since Lightning calls ``training_step``, never the root module's ``forward``.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _destroy_process_group_at_exit() -> None:
    DistributedManager.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


class MeshStrategy(ParallelStrategy):
    """Train a LightningModule on mesh3d's (batch, domain, model) mesh.

    Usage: ``pl.Trainer(accelerator="cpu", devices=4, strategy=MeshStrategy(batch=2, model=2, plan=plan))``

    Args:
        batch, domain, model: axis sizes, as for ``DistributedManager.initialize`` (one may be -1:
            inferred from ``devices * num_nodes``). Checked when the Trainer is built, before any
            process is started.
        plan: a ``mesh3d.Plan`` whose globs name the LightningModule's submodules (e.g.
            ``"net.layers.*.up"``); applied in ``setup`` after ``configure_model()``. ``None``: the
            module's ``configure_model()`` parallelizes itself (``self.device_mesh`` is the 3-D mesh).
        domain_dims: split each batch's tensors over the domain axis after it reaches the device:
            an int (that dim of every tensor), a list aligned with a tuple batch (``None`` keeps an
            item whole) or a dict ``{key: dim}``. ``None``: batches stay whole (shard them yourself in
            ``on_after_batch_transfer`` with ``mesh3d.domain.shard``).
        seed: mesh-independent initialization of a meta-device module (``Trainer.init_module
            (empty_init=True)``) or, when given, re-initialization of a materialized one.
        timeout: seconds (or timedelta) any collective may wait; default ``MESH3D_TIMEOUT`` or 10 min.
        process_group_backend: ``"gloo"``/``"nccl"``; default from the accelerator.

    Distributed sampling follows the batch axis (ranks sharing a batch coordinate read the same
    samples). A ``mesh3d.data.MeshDataLoader`` returned by ``train_dataloader()`` is kept as it is
    (Lightning's sampler is not swapped in) and its cursor is saved with the loop state, so a run
    resumed from a mid-epoch checkpoint on another mesh trains on the same global batches as the
    uninterrupted run; a plain ``DataLoader`` gets Lightning's ``DistributedSampler``, which restarts
    its epoch on resume. ``reduce`` (so ``self.log(..., sync_dist=True)``) and ``all_gather`` default to the
    batch axis; ``barrier``/``broadcast`` span every rank. Checkpoints are mesh3d checkpoint
    directories (see ``mesh3d.lightning.checkpointing``).
    """

    def __init__(
        self,
        batch: int = -1,
        domain: int = 1,
        model: int = 1,
        plan: Plan | None = None,
        *,
        domain_dims: DomainDims | None = None,
        seed: int | None = None,
        timeout: float | timedelta | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, size in (("batch", batch), ("domain", domain), ("model", model)):
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise ValueError(f"MeshStrategy({name}={size!r}): axis sizes are positive ints, or -1 for one inferred size")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"MeshStrategy(plan=...) takes a mesh3d.Plan or None, got {type(plan).__name__}")
        check_domain_dims(domain_dims)
        self._sizes = (batch, domain, model)
        self._plan = plan
        self._domain_dims = domain_dims
        self._seed = seed
        self._timeout = as_timeout(timeout)
        self._process_group_backend = process_group_backend
        self._dm: DistributedManager | None = None
        self._planned: torch.nn.Module | None = None  # the module this strategy's plan was applied to
        self.num_nodes = 1

    # ------------------------------------------------------------------ mesh and ranks
    @property
    def manager(self) -> DistributedManager:
        """The ``DistributedManager`` (available once the Trainer has started its processes)."""
        if self._dm is None:
            raise RuntimeError("MeshStrategy.manager is set up when the Trainer starts (fit/validate/test/predict)")
        return self._dm

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 3-D ``DeviceMesh`` with axes ``("batch", "domain", "model")``."""
        return self.manager.mesh

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True  # tells Lightning to give each batch coordinate its own DistributedSampler

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that share a batch coordinate (domain and model peers) must see the same samples.
        return {"num_replicas": self.manager.axis_size("batch"), "rank": self.manager.axis_rank("batch")}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint is read straight into the parallelized model and its optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already restored the optimizer, resharded

    def _mesh_shape(self) -> tuple[int, int, int]:
        return resolve_mesh_shape(self.num_nodes * self.num_processes, *self._sizes)

    def _configure_launcher(self) -> None:
        self._mesh_shape()  # wrong sizes fail here, in the one process, before any other starts
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        shape = self._mesh_shape()
        backend = self._process_group_backend or default_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        if not dist.is_initialized():
            init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
            # A gloo group still alive at interpreter exit can abort the process ("terminate called
            # without an active exception") and fail the job; destroy what this strategy created.
            atexit.register(_destroy_process_group_at_exit)
        self._dm = DistributedManager.initialize(*shape, timeout=self._timeout)
        module = self.lightning_module
        assert module is not None
        set_module_device_mesh(module, self._dm.mesh)  # what configure_model() sees as self.device_mesh
        if already_parallel(module) is None:
            # Precision's dtype first (e.g. "64-true"): FSDP needs one dtype, and configure_model may shard.
            self.model = self.precision_plugin.convert_module(module)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's idiom

    # ------------------------------------------------------------------ model
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self._apply_plan(module)
        meta = [name for name, p in module.named_parameters() if p.is_meta]
        if meta:
            raise RuntimeError(
                f"{type(module).__name__} still has parameters on the meta device after configure_model() (e.g. "
                f"{meta[0]!r}); give MeshStrategy a plan, or call mesh3d.parallelize(...) in configure_model(), which "
                "materializes them with mesh-independent initialization"
            )
        self._register_step_methods(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._use_mesh_gradient_clipping()

    def _apply_plan(self, module: pl.LightningModule) -> None:
        if self._plan is None:
            if already_parallel(module) is None and self.world_size > 1 and not is_overridden("configure_model", module):
                raise TypeError(
                    f"MeshStrategy has no plan and {type(module).__name__} does not override configure_model(); pass "
                    "MeshStrategy(plan=mesh3d.Plan(...)), or parallelize the module in configure_model() with "
                    "mesh3d.parallelize(self, plan)"
                )
            return
        if module is self._planned:
            return  # a later fit/validate/test with the same module: already laid out on this mesh
        reason = already_parallel(module)
        if reason is not None:
            raise RuntimeError(
                f"{type(module).__name__} is parallelized twice: its configure_model() already parallelized it "
                f"({reason}) and MeshStrategy(plan=...) would apply a plan on top; keep one of the two (drop plan=, "
                "or the parallelize/fully_shard calls in configure_model)"
            )
        parallelize(module, self._plan, seed=self._seed)
        self._planned = module

    def _register_step_methods(self, module: pl.LightningModule) -> None:
        if not isinstance(module, FSDPModule):
            return
        for name in _STEP_METHODS:
            # Registering sets the wrapped method on the instance (the plain one lives on the class), so
            # an instance attribute means it is registered already: no marker on the user's module.
            if name not in vars(module):
                register_fsdp_forward_method(module, name)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _use_mesh_gradient_clipping(self) -> None:
        # Lightning clips with torch.nn.utils.clip_grad_norm_, which fails on DTensors of different
        # meshes (or counts replicated shards twice); mesh3d's version does the global norm right.
        precision = self.precision_plugin

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            clip_grad_norm_(list(precision.main_params(optimizer)), clip_val)

        precision.clip_grad_by_norm = clip_grad_by_norm

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init: parameters on meta; parallelize() materializes each shard where it lives.
        with built_on_meta() if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ steps
    def process_dataloader(self, dataloader: Any) -> Any:
        """Refuse a ``MeshSampler`` split over other batch ranks than this mesh's batch axis."""
        sampler = getattr(dataloader, "sampler", None)
        check_mesh_sampler(sampler, self.manager)
        if isinstance(sampler, MeshSampler):
            # Lightning counts an epoch that max_steps stopped half-way as finished, so after such a
            # resume its set_epoch(e) would skip the rest of the data's epoch: the cursor alone decides.
            sampler.follow_set_epoch = False
        return dataloader

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, self._domain_dims) if self.manager.axis_size("domain") > 1 else batch

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return plain_step_output(super().training_step(*args, **kwargs), "training_step")

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return plain_step_output(super().validation_step(*args, **kwargs), "validation_step")

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return plain_step_output(super().test_step(*args, **kwargs), "test_step")

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.manager.group("world") if self._dm else None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Reduce over ``group``; by default the batch axis (domain/model peers hold the same value)."""
        tensor = plain_step_output(tensor, "the value to reduce")
        if not isinstance(tensor, Tensor):
            return tensor
        return sync_if_available(tensor, group if group is not None else self.manager.group("batch"), reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` over the batch axis: one copy per batch index, not D*M copies of each.

        ``LightningModule.all_gather`` passes ``torch.distributed.group.WORLD`` when the user names
        no group, so WORLD means the batch axis here too; any other group is used as given.
        """
        tensor = plain_step_output(tensor, "the value to all_gather")
        if group is None or group is dist.group.WORLD:
            group = self.manager.group("batch")
        return all_gather_if_available(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        flag = torch.tensor(int(decision), device=self.root_device)
        total = int(sync_if_available(flag, self.manager.group("world"), "sum").item())
        return total == self.world_size if all else total > 0

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the tensors are written shard by shard in save_checkpoint

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint already restored the model

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def _the_optimizer(self) -> torch.optim.Optimizer | None:
        if not self.optimizers:
            return None
        if len(self.optimizers) > 1:
            raise NotImplementedError(
                f"MeshStrategy checkpoints hold one optimizer; this module has {len(self.optimizers)}. Use one "
                "optimizer over all parameters (param groups can differ), or save with weights_only=True"
            )
        optimizer = self.optimizers[0]
        return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the torch one

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MeshStrategy.save_checkpoint(storage_options=...) is not supported: mesh3d writes the files")
        path = self.broadcast(str(filepath))
        optimizer = self._the_optimizer() if "optimizer_states" in checkpoint else None
        assert self.lightning_module is not None
        save_lightning_checkpoint(path, self.lightning_module, optimizer, checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        assert self.lightning_module is not None
        return load_lightning_checkpoint(path, self.lightning_module, self._the_optimizer(),
                                         strict=self.lightning_module.strict_loading)

    def remove_checkpoint(self, filepath: Any) -> None:
        remove_checkpoint(str(filepath))

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        # The process group and the mesh stay up: a later trainer.test()/fit() on this process reuses them.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
