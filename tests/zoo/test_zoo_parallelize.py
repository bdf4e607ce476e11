"""Zoo transformers composed with FSDP: Hugging Face's ViT and Swin, unchanged, on (batch 2) x (domain 2) with
``parallelize(model, Plan(batch="fsdp"))``, train 3 SGD steps equal to one process on the global batch (fp64):
losses, every gradient before each step and the parameters after. (A decoder with tensor parallelism on the model
axis: tests/test_domain_ring_model.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

TOL = 1e-9


def _fsdp_body(name: str, sizes: tuple[int, ...], steps: int = 3):
    import torch.distributed as dist

    from domain_cases import max_err
    from mesh3d import DistributedManager, Plan, domain, parallelize
    from parallel_models import full

    from zoo.models import ZOO, to_fp64

    entry = ZOO[name]
    dm = DistributedManager.initialize(batch=2, domain=2, model=1)
    torch.manual_seed(0)
    ref = to_fp64(entry.build())
    model = parallelize(copy.deepcopy(ref), Plan(batch="fsdp"))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    x = torch.randn((2, *entry.shape[1:]), generator=g, dtype=torch.float64)       # the global batch: 2 samples
    b = dm.axis_rank("batch")
    xs = domain.shard(x[b:b + 1], dim=entry.dim, sizes=sizes)                        # this batch rank's sample
    errs = []
    for _ in range(steps):
        opt_ref.zero_grad()
        y = entry.forward(ref, x)
        loss_ref = (y ** 2).mean()
        loss_ref.backward()
        opt_ref.step()
        opt.zero_grad()
        loss = (entry.forward(model, xs) ** 2).mean()                              # this rank's sample's mean
        loss.backward()
        both = loss.detach().to_local().clone()
        dist.all_reduce(both, group=dm.group("batch"))
        errs.append(abs(float(both) / 2 - float(loss_ref)))
        errs.append(max(max_err(full(p.grad), q.grad) for p, q in zip(model.parameters(), ref.parameters())))
        opt.step()
    errs.append(max(max_err(full(p), q) for p, q in zip(model.parameters(), ref.parameters())))
    return max(errs)


@pytest.mark.parametrize("name, sizes", [("transformers.ViT", (10, 6)), ("transformers.Swin", (4, 12))])
def test_vision_transformers_with_fsdp_train_like_one_process(ranks, name, sizes):
    for err in ranks.run(4, _fsdp_body, name, sizes, timeout=300):
        assert err < TOL, (name, err)
