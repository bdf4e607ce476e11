"""All three axes resharded at once, with domain tensors: train on (2, 2, 2), resume with batch, domain and model changed.

The U-Net and the ViT of the domain tests (FSDP on batch x domain, TP styles on model: the ViT's MLPs colwise/rowwise,
the U-Net's convolutions and norms replicated) train 2 Adam steps on (2, 2, 2) with uneven slabs, save, and resume on
(1, 4, 2) and (4, 1, 2) (slabs) and on (1, (2, 2), 2) (a 2x2 block grid) for 2 more steps. Everything is compared in
fp64 with one process that trains the 4 steps without a break: the loss and the raw gradients at every step, the
parameters and Adam's moments and step count at the end. One rank-pool body runs both models and every target.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from domain_compose import UNET_STYLES, VIT_STYLES
from domain_models import H, W, TinyUNet, TinyViT
from parallel_models import full

TOL = 1e-9
SAMPLES = 4                       # the global batch of every step
LR = 1e-2
SOURCE = ((2, 2, 2), {"unet": (10, 4), "vit": (8, 6)})
TARGETS = (((1, 4, 2), {"unet": (5, 1, 6, 2), "vit": (2, 6, 4, 2)}),
           ((4, 1, 2), {"unet": None, "vit": None}),
           ((1, (2, 2), 2), {"unet": ((8, 6), (6, 4)), "vit": ((8, 6), (6, 4))}))


def _make(kind: str, seed: int):
    torch.manual_seed(seed)
    return (TinyUNet() if kind == "unet" else TinyViT()).double()


def _data(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(SAMPLES, 2, H, W, generator=g, dtype=torch.float64)
    y = torch.randn(SAMPLES, 2, H, W, generator=g, dtype=torch.float64) if kind == "unet" else \
        torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)
    return x, y


def _moments(opt, params) -> list[dict[str, torch.Tensor]]:
    return [{k: full(v).double() if torch.is_tensor(v) else torch.tensor(float(v)) for k, v in opt.state[p].items()}
            for p in params]


def _one_process(kind: str, steps: int) -> dict:
    """The uninterrupted run: losses and gradients per step, parameters and Adam's state at the end."""
    ref = _make(kind, 0)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    out = {"losses": [], "grads": []}
    for step in range(steps):
        x, y = _data(kind, step)
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        out["losses"].append(float(loss))
        out["grads"].append([p.grad.clone() for p in ref.parameters()])
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().clone() for p in ref.parameters()]
    out["moments"] = _moments(opt, list(ref.parameters()))
    return out


def _train(dm, kind: str, shape, sizes, model, opt, steps: range, ref: dict) -> float:
    """``steps`` of the parallel run on this batch rank's samples; the worst loss and gradient error."""
    from mesh3d import domain

    nb, b = dm.axis_size("batch"), dm.axis_rank("batch")
    mine = slice(b * SAMPLES // nb, (b + 1) * SAMPLES // nb)
    where = {"dims": (2, 3)} if isinstance(shape[1], tuple) else {"dim": 2}
    worst = 0.0
    for step in steps:
        x, y = _data(kind, step)
        xs = domain.shard(x[mine], sizes=sizes, **where)
        ys = domain.shard(y[mine], sizes=sizes, **where) if kind == "unet" else y[mine]
        loss = F.mse_loss(model(xs), ys)
        loss.backward()
        total = loss.detach().to_local().clone() if isinstance(loss, domain.DomainTensor) else loss.detach().clone()
        dist.all_reduce(total, group=dm.group("batch"))  # each batch rank's mean, averaged: the global mean
        worst = max(worst, abs(float(total) / nb - ref["losses"][step]),
                    *(float((full(p.grad) - g).abs().max()) for p, g in zip(model.parameters(), ref["grads"][step])))
        opt.step()
        opt.zero_grad()
    return worst


def _build(kind: str, shape, seed: int):
    from mesh3d import DistributedManager, Plan, parallelize

    dm = DistributedManager.initialize(*shape)
    model = parallelize(_make(kind, seed), Plan(batch="fsdp", model=UNET_STYLES if kind == "unet" else VIT_STYLES))
    return dm, model, torch.optim.Adam(model.parameters(), lr=LR)


def _reshard_body(root: str) -> dict:
    """Per model: the source run's error, then per target its error after loading and 2 more steps, and the final
    parameter and Adam-state errors."""
    from mesh3d import DistributedManager, checkpoint

    report = {}
    for kind in ("unet", "vit"):
        ref = _one_process(kind, 4)
        path = os.path.join(root, kind)
        shape, sizes = SOURCE
        dm, model, opt = _build(kind, shape, seed=0)
        report[(kind, "source")] = _train(dm, kind, shape, sizes[kind], model, opt, range(2), ref)
        checkpoint.save(path, model, opt, step=2)
        DistributedManager.shutdown()
        for shape, sizes in TARGETS:
            dm, model, opt = _build(kind, shape, seed=1)  # other weights: the load must replace every one
            info = checkpoint.load(path, model, opt)
            assert info.step == 2, info
            err = _train(dm, kind, shape, sizes[kind], model, opt, range(2, 4), ref)
            params = max(float((full(p) - q).abs().max()) for p, q in zip(model.parameters(), ref["params"]))
            moments = max(float((m[k] - r[k]).abs().max()) for m, r in zip(_moments(opt, list(model.parameters())),
                                                                              ref["moments"]) for k in r)
            report[(kind, str(shape))] = (err, params, moments)
            DistributedManager.shutdown()
    return report


def test_unet_and_vit_resume_with_batch_domain_and_model_all_changed(ranks, tmp_path):
    for report in ranks.run(8, _reshard_body, str(tmp_path), timeout=400):
        for case, errors in report.items():
            assert max(errors if isinstance(errors, tuple) else (errors,)) < TOL, (case, errors)
        assert len(report) == 2 * (1 + len(TARGETS)), report
