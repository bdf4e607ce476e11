"""The batch axis: FSDP2, HSDP or DDP over the batch×domain ranks, with mesh3d's gradient rule.

Gradient rule: parameter gradients are AVERAGED over ``batch`` and SUMMED over ``domain``
(domain ranks each compute a part of one sample's loss, so their contributions add up).
FSDP2 would average over all batch·domain ranks; mesh3d makes it sum and divide by the
batch size only. Not with ``set_gradient_divide_factor(batch)``: on gloo it asks for
PREMUL_SUM, which gloo lacks, and in torch 2.13 with force-sum reductions it divides TWICE
when the shard group has one rank (HSDP with shard size 1, DDP): the copy that replaces the
reduce-scatter divides by the factor and the post-division divides again. Instead every
reduction is a plain SUM, FSDP divides by batch·domain, and an all-reduce hook multiplies by
domain in between.

Usage::

    apply_batch_parallel(model, plan, units=["layers.0", "layers.1", ""], dm=DistributedManager())
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from mesh3d._torch_private import own_output
from mesh3d.manager import DistributedManager
from mesh3d.parallel.plan import Plan
from mesh3d.parallel.validate import hsdp_shard_size

__all__ = ["apply_batch_parallel", "batch_mesh"]


def batch_mesh(plan: Plan, dm: DistributedManager) -> DeviceMesh:
    """The mesh ``fully_shard`` gets: 1-D batch×domain for FSDP, 2-D (replicate, shard) for HSDP and DDP.

    The 2-D split is the manager's (made once per manager, so later parallelize calls reuse its groups).
    """
    if plan.batch == "fsdp":
        return dm.batch_domain_mesh
    return dm.batch_domain_split(1 if plan.batch == "ddp" else hsdp_shard_size(plan, dm.shape))


def apply_batch_parallel(model: nn.Module, plan: Plan, units: list[str], dm: DistributedManager) -> None:
    """``fully_shard`` every unit bottom-up (``units`` is deepest first, root ``""`` last), in place."""
    mesh = batch_mesh(plan, dm)
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    # Pinned memory needs an accelerator; on a CPU mesh offloading is a no-op move anyway.
    offload = CPUOffloadPolicy(pin_memory=dm.device.type != "cpu") if plan.cpu_offload else OffloadPolicy()
    for fqn in units:
        module = model.get_submodule(fqn)
        # The root's parameters are needed right after forward (backward starts there), so
        # resharding it would only add an all-gather; FSDP itself makes the same choice.
        reshard = plan.reshard_after_forward if fqn else False
        module.register_forward_hook(_own_outputs)  # NOTE: before fully_shard: runs before FSDP's post-forward hook
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    domain = dm.axis_size("domain")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # SUM collectives, then FSDP divides by batch·domain once; the hook (run between the
            # reduction and that division) multiplies by domain, so the net is sum / batch.
            module.set_force_sum_reduction_for_comms(True)
            if domain > 1:
                module.set_all_reduce_hook(_times(domain))


def _own_outputs(_module: nn.Module, _args: tuple, output: object) -> object:
    """A unit's outputs that are autograd views only in name (a tensor-parallel module's ``DTensor.to_local()``, when
    it is the unit's last module) as tensors of their own: FSDP2 would warn that an in-place op on such a view drops
    the unit's pre-backward hook (``own_output``). A tensor, or a plain tuple or list of them; any other structure
    (a dict, a model's output class) is left as it is, and nothing is replaced when nothing changes."""
    if isinstance(output, torch.Tensor):
        own = own_output(output)
        return None if own is output else own
    if isinstance(output, (tuple, list)) and type(output) in (tuple, list):  # not a named tuple or another subclass
        items = [own_output(o) for o in output]
        if all(a is b for a, b in zip(items, output)):
            return None
        return tuple(items) if isinstance(output, tuple) else items
    return None


def _times(factor: int):
    def hook(reduced: torch.Tensor) -> None:
        reduced.mul_(factor)

    return hook
