"""A small U-Net trained 3 Adam steps on domain meshes (1,2,1) and (1,4,1), uneven shards, vs one process.

fp64 because Adam divides by sqrt(v): summation-order noise in a near-zero gradient would move a
weight by ~lr at fp32 (see torch_pitfalls.md); tolerance 1e-9 on losses and parameters.
Gradient rule: after backward, parameter grads are SUMMED over the domain group (what parallelize does).
"""

from __future__ import annotations

import copy

import pytest
import torch

from domain_cases import domain_sum, max_err, sum_grads_over_domain
from domain_models import H, W, TinyUNet, TinyViT
from mesh3d import DistributedManager, domain
from mesh3d._torch_private import checkpoint_module


def _train_body(sizes, steps=3, nested_checkpoints=False):
    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    ref = TinyUNet().double()
    model = copy.deepcopy(ref)
    if nested_checkpoints:  # the whole model and, inside it, its encoder and middle (halo convs, GroupNorm)
        for module in (model, model.enc, model.mid):
            checkpoint_module(module)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(2, 2, H, W, dtype=torch.float64)
    target = torch.randn(2, 2, H, W, dtype=torch.float64)
    xs, ts = domain.shard(x, dim=2, sizes=sizes), domain.shard(target, dim=2, sizes=sizes)
    loss_errs = []
    for _ in range(steps):
        opt_ref.zero_grad()
        loss_ref = torch.nn.functional.mse_loss(ref(x), target)
        loss_ref.backward()
        opt_ref.step()

        opt.zero_grad()
        # NOTE: overlap off in forward only: a recomputation (in backward, outside the block) must still run without
        with domain.window_overlap(not nested_checkpoints):
            loss = torch.nn.functional.mse_loss(model(xs), ts)  # replicated: the one-process value on every rank
        loss.backward()
        sum_grads_over_domain(model.parameters())
        # raw gradients too (Adam is scale-invariant: it would hide a gradient off by a factor of D)
        loss_errs.append(max(max_err(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters())))
        opt.step()
        loss_errs.append(abs(float(loss.detach()) - float(loss_ref.detach())))
    param_err = max(max_err(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    return max(loss_errs), param_err


@pytest.mark.parametrize(("world", "sizes"), [(2, (9, 5)), (2, None), (4, (5, 1, 6, 2)), (4, (1, 4, 4, 5))])
def test_unet_trains_like_one_process(ranks, world, sizes):
    for loss_err, param_err in ranks.run(world, _train_body, sizes, timeout=90):
        assert loss_err < 1e-9
        assert param_err < 1e-9


@pytest.mark.parametrize(("world", "sizes"), [(2, (9, 5)), (4, (5, 1, 6, 2))])
def test_nested_activation_checkpointing_recomputes_as_forward_ran(ranks, world, sizes):
    """Activation checkpointing of the U-Net and, nested inside it, of its encoder and middle: each recomputation
    gets domain tensors back (not the bare shards another checkpoint's saved tensors unpack to) and the halo
    overlap setting its forward ran with."""
    for loss_err, param_err in ranks.run(world, _train_body, sizes, 3, True, timeout=90):
        assert loss_err < 1e-9
        assert param_err < 1e-9


def _reentrant_body(sizes):
    from torch.utils.checkpoint import checkpoint

    DistributedManager.initialize(batch=1, domain=len(sizes))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 2, 3, padding=1).double()
    x = torch.randn(1, 1, sum(sizes), 4, dtype=torch.float64)
    checkpoint(conv, x.requires_grad_(), use_reentrant=False).square().sum().backward()
    want = conv.weight.grad.clone()
    conv.weight.grad = None
    xs = domain.shard(x.detach(), dim=2, sizes=sizes).requires_grad_()
    try:
        checkpoint(conv, xs, use_reentrant=True)
        refused = ""
    except ValueError as err:
        refused = str(err)
    checkpoint(conv, xs, use_reentrant=False).square().sum().backward()   # the way out, exact
    got = domain_sum(conv.weight.grad)
    DistributedManager.shutdown()
    return refused, max_err(got, want)


def test_reentrant_checkpointing_is_refused_by_name_and_the_non_reentrant_one_runs(ranks):
    """use_reentrant=True would replay the block with this rank's gradient shards as whole gradients (before, a
    ValueError about grad_outputs' shape from inside torch.utils.checkpoint's backward): refused at the forward on
    every rank, naming use_reentrant=False, which gives the one-process gradients."""
    for refused, err in ranks.run(2, _reentrant_body, (4, 3), timeout=90):
        assert refused.startswith("torch.utils.checkpoint.checkpoint(..., use_reentrant=True) does not run on domain "
                                  "tensors") and "Pass use_reentrant=False" in refused, refused
        assert err < 1e-12


def _mesh_train_body(shape, sizes, steps=3):
    """Domain inside a (batch, domain, model) mesh: peers must be the domain sub-mesh, not global rank +- 1.

    Each batch rank trains on its own sample; gradients are summed over domain then averaged over batch,
    which must equal one process training on the whole batch (mean loss).
    """
    import torch.distributed as dist

    dm = DistributedManager.initialize(*shape)
    torch.manual_seed(0)
    ref = TinyUNet().double()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    nb = dm.axis_size("batch")
    x = torch.randn(nb, 2, H, W, dtype=torch.float64)
    target = torch.randn(nb, 2, H, W, dtype=torch.float64)
    b = dm.axis_rank("batch")
    xs = domain.shard(x[b:b + 1], dim=2, sizes=sizes)
    ts = domain.shard(target[b:b + 1], dim=2, sizes=sizes)
    for _ in range(steps):
        opt_ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), target).backward()
        opt_ref.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ts).backward()
        sum_grads_over_domain(model.parameters())
        for p in model.parameters():
            if nb > 1:
                dist.all_reduce(p.grad, group=dm.group("batch"))
                p.grad /= nb
        opt.step()
    return max(max_err(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize(("shape", "sizes"), [((2, 2, 1), (10, 4)), ((1, 2, 2), (3, 11))])
def test_unet_on_multi_axis_meshes(ranks, shape, sizes):
    for param_err in ranks.run(4, _mesh_train_body, shape, sizes, timeout=90):
        assert param_err < 1e-9


def _vit_body(sizes, steps=3):
    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    ref = TinyViT().double()
    model = copy.deepcopy(ref)
    # SGD, not Adam: Adam is scale-invariant and would hide a gradient off by a factor of D
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(2, 2, H, W, dtype=torch.float64)
    y = torch.randn(2, 3, dtype=torch.float64)
    xs = domain.shard(x, dim=2, sizes=sizes)
    for _ in range(steps):
        opt_ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), y).backward()
        sum_grads_over_domain(model.parameters())
        opt.step()
    return max(max_err(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize(("world", "sizes"), [(2, (8, 6)), (4, (2, 6, 4, 2))])
def test_vit_on_sharded_token_grid_trains_like_one_process(ranks, world, sizes):
    for param_err in ranks.run(world, _vit_body, sizes, timeout=90):
        assert param_err < 1e-9
