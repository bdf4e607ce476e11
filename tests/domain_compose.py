"""The domain-tensor training body composed with ``parallelize`` (FSDP on batch, TP styles on model), shared by
``test_domain_parallelize`` and ``test_domain_compile`` (imported on every rank): 3 steps of the U-Net or the ViT
against one process, returning the largest loss, raw-gradient and parameter errors."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable.contract import _get_registry

from domain_cases import max_err
from domain_models import H, W, TinyUNet, TinyViT
from mesh3d import DistributedManager, Plan, domain, parallelize
from parallel_models import full

__all__ = ["compose_body"]

PER_RANK = 2  # samples per batch rank
UNET_STYLES = {name: "replicate" for name in ("enc.0", "enc.1", "down", "mid.0", "mid.1", "up_t", "dec")}
VIT_STYLES = {"mlp.0": "colwise", "mlp.2": "rowwise", "head.0": "colwise", "head.2": "rowwise", "embed": "replicate"}


def _data(kind: str, n: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 2, H, W, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, H, W, generator=g, dtype=torch.float64) if kind == "unet" else torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, y


def _optimizer(kind: str, params):
    if kind == "unet":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def compose_body(shape, kind, sizes, steps=3, param_dtype=None, compile_options=None, checkpoint=None):
    dm = DistributedManager.initialize(*shape)
    torch.manual_seed(0)
    ref = (TinyUNet() if kind == "unet" else TinyViT()).double()
    styles = (UNET_STYLES if kind == "unet" else VIT_STYLES) if shape[2] > 1 else None
    model = parallelize(copy.deepcopy(ref), Plan(batch="fsdp", model=styles, param_dtype=param_dtype,
                                                 compile=compile_options or False, checkpoint=checkpoint or []))
    for name in checkpoint or []:  # activation checkpointing applied where the plan said, compiled or not
        assert "checkpoint" in (_get_registry(model.get_submodule(name)) or {}), name
    opt_ref, opt = _optimizer(kind, ref.parameters()), _optimizer(kind, model.parameters())

    nb, b = dm.axis_size("batch"), dm.axis_rank("batch")
    x, y = _data(kind, nb * PER_RANK)
    mine = slice(b * PER_RANK, (b + 1) * PER_RANK)
    # a domain grid (blocks over H and W) or slabs over H
    where = {"dims": (2, 3)} if isinstance(shape[1], tuple) else {"dim": 2}
    xs = domain.shard(x[mine], sizes=sizes, **where)
    ys = domain.shard(y[mine], sizes=sizes, **where) if kind == "unet" else y[mine]

    loss_errs, grad_errs = [], []
    for _ in range(steps):
        opt_ref.zero_grad()
        loss_ref = F.mse_loss(ref(x), y)
        loss_ref.backward()
        opt_ref.step()

        opt.zero_grad()
        loss = F.mse_loss(model(xs), ys)  # the mean over this batch rank's samples, on every domain rank
        loss.backward()
        global_loss = loss.detach().to_local().clone() if isinstance(loss, domain.DomainTensor) else loss.detach().clone()
        dist.all_reduce(global_loss, group=dm.group("batch"))
        loss_errs.append(abs(float(global_loss) / nb - float(loss_ref)))
        ref_grads = [p.grad for p in ref.parameters()]  # the step above does not touch .grad
        grad_errs.append(max(max_err(full(p.grad), g) for p, g in zip(model.parameters(), ref_grads)))
        opt.step()
    param_err = max(max_err(full(p), q) for p, q in zip(model.parameters(), ref.parameters()))
    return max(loss_errs), max(grad_errs), param_err
