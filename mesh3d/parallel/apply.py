"""``parallelize(model, plan)``: one call that spreads a model over the manager's (batch, domain, model) mesh.

Fixed order: tensor parallelism on the model axis → activation checkpointing → compile of each block
(``Plan.compile``) → FSDP/HSDP/DDP on the batch×domain ranks (units bottom-up, root last) → initialization of a meta model.
Every check runs before the first collective; the one collective before any work is a hash
of the plan and model, all-gathered over every rank, so plans that differ raise everywhere.

Usage::

    from mesh3d import DistributedManager, Plan, parallelize
    DistributedManager.initialize(batch=2, domain=1, model=2)
    model = parallelize(model, Plan(model={"layers.*.up": "colwise", "layers.*.down": "rowwise"}))
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mesh3d._torch_private import checkpoint_module
from mesh3d.manager import DistributedManager
from mesh3d.parallel.batch_parallel import apply_batch_parallel
from mesh3d.parallel.compile_blocks import apply_compile, compile_options, compiled_blocks
from mesh3d.parallel.init import InitFn, capture_init_specs, materialize
from mesh3d.parallel.plan import Plan
from mesh3d.parallel.tensor_parallel import apply_tp
from mesh3d.parallel.validate import default_units, resolve_plan

__all__ = ["parallelize", "check_same_plan_everywhere"]


def check_same_plan_everywhere(plan: Plan, model: nn.Module, dm: DistributedManager) -> None:
    """All-gather one hash of (plan, parameter names/shapes) over every rank; raise on every rank if they differ.

    The collective is bounded by the manager's timeout (a rank that never calls parallelize
    makes the others raise after it instead of hanging).
    """
    if dm.world_size == 1:
        return
    mine = torch.tensor([plan.fingerprint(model)], dtype=torch.int64, device=dm.device)
    gathered = [torch.zeros_like(mine) for _ in range(dm.world_size)]
    dist.all_gather(gathered, mine, group=dm.group("world"))
    values = [int(t.item()) for t in gathered]
    if len(set(values)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        listing = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise RuntimeError(
            f"the plan or the model differs between ranks (ranks with equal plan+model: {listing}); every rank must "
            f"call parallelize with the same Plan and the same model structure. This rank's plan: {plan.describe()}"
        )


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    init_fn: InitFn | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Parallelize ``model`` in place over ``DistributedManager()``'s mesh and return it.

    Usage: ``model = parallelize(model, Plan(batch="fsdp", model={"mlp.up": "colwise"}), seed=0)``

    Parameter names (``named_parameters()``, ``state_dict()``) stay those of the plain model.
    A model on the meta device is materialized on ``dm.device`` with mesh-independent
    initialization (``seed``, default 0; ``init_fn(module)`` fills one module's own parameters,
    default ``module.reset_parameters()``). Passing ``seed`` for a materialized model
    re-initializes it the same way. Raises ``ValueError``/``RuntimeError`` on every rank,
    before any work, for a plan that does not fit the model or the mesh.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a mesh3d.Plan, got {type(plan).__name__}")
    dm = DistributedManager()
    resolved = resolve_plan(plan, model, dm.shape)
    meta = _is_meta(model)
    if init_fn is not None and not meta and seed is None:
        raise ValueError("init_fn is used to initialize a meta-device model or with seed=...; pass seed= too")
    specs = capture_init_specs(model) if (meta or seed is not None) else None
    check_same_plan_everywhere(plan, model, dm)

    if not meta:
        model.to(dm.device)
    apply_tp(model, resolved.styles, dm.axis_mesh("model"), meta=meta)
    for fqn in resolved.checkpointed:
        checkpoint_module(model.get_submodule(fqn))
    options = compile_options(plan.compile)
    if options is not None:
        apply_compile(model, compiled_blocks(model, resolved.units or default_units(model)), options)
    if plan.batch is not None:
        apply_batch_parallel(model, plan, resolved.units, dm)
    if specs is not None:
        materialize(model, specs, 0 if seed is None else seed, init_fn, dm.device)
    model._mesh3d_parallelized = True  # mesh3d's one marker on the user's module (see already_parallel)
    return model
