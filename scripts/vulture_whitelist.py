"""Names the dead-code check (vulture, in scripts/lint.sh) must not report: each is used by something
vulture cannot see (Python's protocols, torch's and Lightning's hooks, keyword names that mirror
torch's signatures, public API used only by callers outside the repository).
Not imported by anything; vulture reads it. An entry here is a decision, not a mute: say why."""
# ruff: noqa: F821
# mypy: ignore-errors

# Python protocols.
__getattr__  # mesh3d/__init__.py: module-level lazy subpackages
_.__class__  # mesh3d/domain/core/tensor.py: assigning __class__ makes the subclass instance

# Keyword names that mirror torch's signatures (the op rules receive them and ignore them).
inplace  # mesh3d/domain/ops/pointwise.py: F.dropout(..., inplace=)
size_average  # mesh3d/domain/ops/reduce.py: F.mse_loss/l1_loss legacy keywords
tensor_contents  # mesh3d/domain/core/tensor.py: torch.Tensor.__repr__(*, tensor_contents=)
weights_only  # mesh3d/lightning/strategy.py: Strategy.load_checkpoint(..., weights_only=)

# Attributes and hooks that torch or Lightning read.
_.total_size  # mesh3d/data/sampler.py: DistributedSampler's attribute, kept consistent
_._modules  # mesh3d/parallel/init.py: nn.Module internals of the bodiless clone
_._apply  # mesh3d/parallel/tensor_parallel.py: ParallelStyle._apply, called by parallelize_module
_.process  # mesh3d/log.py: logging.LoggerAdapter.process
_._device_mesh  # mesh3d/lightning/_lightning_private.py: read by Lightning
_.is_distributed  # mesh3d/lightning/strategy.py: Strategy API below, all called by Lightning
_.distributed_sampler_kwargs
_.restore_checkpoint_after_setup
_.lightning_restore_optimizer
_._configure_launcher
_._launcher
_.process_dataloader
_.lightning_module_state_dict
_.optimizer_state
_.load_model_state_dict
_.load_optimizer_state_dict
_.load_checkpoint

# Public API with no caller inside the repository (documented in docs/api.md).
_.warning_rank0  # mesh3d/log.py
_.world_mesh  # mesh3d/manager.py
_.explain  # mesh3d/parallel/plan.py: Plan.explain

# Dead, in a module owned by the domain work (#9): to be removed there.

# A torch config flag mesh3d sets (read by torch's AOTAutograd, not by mesh3d): _torch_private/compile.py.
_.check_custom_op_aliasing
# A torch checkpoint frame's attribute mesh3d sets (read by torch's recomputation hook): _torch_private/autograd.py.
_.early_stop

# The process-group protocol torch calls on a Python ProcessGroup (mesh3d/staged_gloo/group.py, work.py): names it
# reads by reflection (getBackendName, the group name and description, the backend for a device, the coalesced
# collectives 2.11 and 2.13 call) and a Work's status queries.
_.getBackendName
_.setGroupName
_.getGroupName
_.setGroupDesc
_.getGroupDesc
_.backend_for
_.all_gather_single_coalesced
_.reduce_scatter_single_coalesced
_.is_success
_.get_future
# The io.RawIOBase protocol h5py calls on the file object it reads through (mesh3d/data/counting.py: CountingFile).
_.readable
_.seekable
# zarr's WrapperStore protocol: zarr calls it to rewrap the store (mesh3d/data/zarr_counting.py: CountingStore).
_._with_store
# PEP 562: dir(mesh3d) lists the lazily loaded public names too (mesh3d/__init__.py).
__dir__
# The attributes Dynamo reads on a function it meets in a trace (mesh3d/_torch_private/compile.py: never_traced,
# constant_in_compiled_graphs, set from Dynamo's C half where torch.compiler's decorators would import its Python half).
_._torchdynamo_disable
_._torchdynamo_disable_msg
_._torchdynamo_orig_callable
_._dynamo_marked_constant
