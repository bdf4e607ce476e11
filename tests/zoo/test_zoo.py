"""The model zoo (tests/zoo/models.py) on 2 ranks and on 3 uneven ranks vs one process, fp64:
output, loss and every parameter gradient (domain-summed) within rtol 1e-9; refusals assert their message."""

from __future__ import annotations

import copy

import pytest
import torch

from domain_cases import domain_sum

pytest.importorskip("monai")  # the optional `zoo` extra (scripts/env.sh installs it)

RTOL = 1e-9
# name -> a piece of the expected refusal (the op that has no exact domain form); every other model must match.
REFUSALS = {
    "monai.SwinUNETR-2d": "",
    "transformers.Swin-classifier": "",
    "neuralop.FNO-2d-grid": "torch.cat: every input must be a domain tensor",
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / (b.abs().max() + 1e-300)) if b.numel() else 0.0


def _zoo_body(names, sizes_by_world):
    from mesh3d import DistributedManager, domain

    from zoo.models import ZOO, to_fp64

    dm = DistributedManager.initialize(batch=1, domain=-1)
    sizes = sizes_by_world.get(dm.axis_size("domain"))
    results = {}
    for name in names:
        _, build, forward, shape, dim = ZOO[name]
        try:
            torch.manual_seed(0)
            ref = to_fp64(build())
            mod = copy.deepcopy(ref)
            x = torch.randn(shape, dtype=torch.float64)
            y = forward(ref, x)
            loss_ref = (y ** 2).mean()
            loss_ref.backward()
            ys = forward(mod, domain.shard(x, dim=dim, sizes=sizes.get(shape[dim]) if sizes else None))
            loss = (ys ** 2).mean()
            loss.backward()
            out = ys.full_tensor().to_local() if ys.sharded_dim is not None else ys.to_local()
            err = max(_rel(out, y), _rel(loss.to_local(), loss_ref))
            for p, q in zip(ref.parameters(), mod.parameters()):
                err = max(err, _rel(domain_sum(q.grad) if q.grad is not None else torch.zeros_like(p), p.grad
                                    if p.grad is not None else torch.zeros_like(p)))
            results[name] = ("ok", err)
        except (NotImplementedError, ValueError) as e:
            results[name] = ("refused", str(e))
    return results


def _names():
    from zoo.models import ZOO

    return list(ZOO)


# uneven 3-rank layouts per sharded length (an empty shard where the model's pooling allows it)
_UNEVEN = {3: {16: (7, 5, 4), 32: (13, 11, 8), 64: (30, 20, 14)}}


@pytest.mark.parametrize("world", [2, 3])
def test_zoo_matches_one_process(ranks, world):
    results = ranks.run(world, _zoo_body, _names(), _UNEVEN, timeout=400)
    for name in _names():
        per_rank = [r[name] for r in results]
        status, value = per_rank[0]
        assert all(s == status for s, _ in per_rank), (name, per_rank)
        if name in REFUSALS:
            assert status == "refused", (name, value)
            assert REFUSALS[name] in value, (name, value)
        else:
            assert status == "ok", (name, value)
            assert all(v < RTOL for _, v in per_rank), (name, per_rank)
