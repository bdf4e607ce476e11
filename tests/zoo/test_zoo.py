"""The model zoo (tests/zoo/models.py) on 2 ranks, on 3 uneven ranks and on a 2x2 grid of blocks vs one process, in fp64:
output, loss and every parameter gradient (summed over the domain) within rtol 1e-9, and buffers
(BatchNorm running statistics) after the step. A model that cannot be supported must raise its
expected error on every rank (never a wrong result)."""

from __future__ import annotations

import copy
import math
import traceback

import pytest
import torch

pytest.importorskip("monai")  # the optional `zoo` extra (scripts/test.sh installs it)

RTOL = 1e-9  # the default of ZooModel.rtol


def _rel(a, b, floor: float = 0.0) -> float:
    """Largest difference relative to the reference's largest magnitude, or to ``floor`` where that is smaller
    (inf on a shape mismatch or where only one side exists)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(max(floor, 1e-300)))


def sizes_for(entry, world: int) -> tuple[int, ...]:
    """The 3-rank split of the entry, or at 2 ranks the even split aligned to the same granularity."""
    from mesh3d.domain.core.split import aligned_sizes

    if world == 3:
        return entry.sizes3
    return tuple(aligned_sizes(entry.shape[entry.dim], world, math.gcd(*entry.sizes3)))


def block_sizes_for(entry) -> tuple[tuple[int, ...], ...]:
    """2x2 blocks over the entry's sharded dim and the next, each split evenly at the entry's granularity."""
    from mesh3d.domain.core.split import aligned_sizes

    step = math.gcd(*entry.sizes3)
    return tuple(tuple(aligned_sizes(entry.shape[d], 2, math.gcd(step, entry.shape[d]))) for d in (entry.dim, entry.dim + 1))


def _one(entry, world: int, blocks: bool = False) -> dict:
    from domain_cases import domain_sums
    from mesh3d import DistributedManager, domain

    torch.manual_seed(0)
    ref = entry.build_fp64()
    try:
        mod = copy.deepcopy(ref)
    except TypeError:  # torch-harmonics' attention holds a torch.ops namespace: built again alike
        torch.manual_seed(0)
        mod = entry.build_fp64()
        mod.load_state_dict(ref.state_dict())
    x = entry.make_input()
    if blocks:
        xs = domain.shard(x, dims=(entry.dim, entry.dim + 1), sizes=block_sizes_for(entry))
    else:
        xs = domain.shard(x, dim=entry.dim, sizes=sizes_for(entry, world))
    # NOTE: the sharded forward first: a refusal raises before the one-process run it does not need. Each run seeds
    # its own stream, so the order changes neither.
    DistributedManager().manual_seed(1)  # the same streams: batch rank 0's is torch.manual_seed(1)
    ys = entry.forward(mod, xs)
    torch.manual_seed(1)  # dropout and stochastic depth at the libraries' defaults, in training mode
    y = entry.forward(ref, x)
    cot = torch.randn_like(y)  # the loss <y, cot>: every output element weighs differently
    loss_ref = (y * cot).sum()
    loss_ref.backward()
    sharded = ys.spec.layout is not domain.Layout.REPLICATED
    if ys.spec.layout is domain.Layout.TOKENS:  # tokens in block order: compare in the global order
        ys, sharded, cot_s = ys.full_tensor(), False, cot
    elif ys.spec.layout is domain.Layout.BLOCKS:
        cot_s = domain.shard(cot, dims=ys.spec.dims, sizes=ys.spec.sizes)
    else:
        cot_s = domain.shard(cot, dim=ys.sharded_dim, sizes=ys.sizes) if sharded else cot
    loss = (ys * cot_s).sum()
    loss.backward()
    errs = {"output": _rel(ys.full_tensor().to_local() if sharded else ys.to_local(), y),
            "loss": _rel(loss.to_local(), loss_ref)}
    # A gradient that is zero in exact arithmetic (a conv bias followed by a norm, an attention key bias)
    # holds only rounding noise; it is measured against the model's largest gradient, not against itself.
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None and p.grad.numel())
    for (name, p), g in zip(ref.named_parameters(), domain_sums([q.grad for q in mod.parameters()])):
        errs[f"grad {name}"] = _rel(g, p.grad, scale)
    # A running mean that is zero in exact arithmetic (a BatchNorm after a normalized bias-free conv: MobileViT) holds
    # rounding noise alone: buffers are measured against the model's largest buffer, as gradients are.
    floats = [b for b in ref.buffers() if b.is_floating_point() and b.numel()]
    buffer_scale = max((float(b.abs().max()) for b in floats), default=0.0)
    for (name, b), c in zip(ref.named_buffers(), mod.buffers()):
        errs[f"buffer {name}"] = _rel(c, b, buffer_scale if b.is_floating_point() else 0.0)
    worst = max(errs, key=errs.get)
    return {"status": "ok", "err": errs[worst], "worst": worst, "grads": sum(k.startswith("grad") for k in errs)}


def _zoo_body(names: list[str], grid: tuple[int, ...] | None = None) -> dict:
    from mesh3d import DistributedManager

    from zoo.models import ZOO

    dm = DistributedManager.initialize(batch=1, domain=grid or -1)
    results = {}
    for name in names:
        try:
            results[name] = _one(ZOO[name], dm.axis_size("domain"), blocks=grid is not None)
        except Exception as e:  # noqa: BLE001 - the test asserts which refusals are expected
            where = traceback.extract_tb(e.__traceback__)[-6:]
            results[name] = {"status": "refused", "error": f"{type(e).__name__}: {e}",
                             "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in where]}
    return results


def _names(refused: bool, layout: str) -> list[str]:
    from zoo.models import ZOO

    return [name for name, entry in ZOO.items() if entry.runs_on(layout) and entry.refused(layout) == refused]


@pytest.mark.parametrize("world", [2, 3])
def test_zoo_models_equal_one_process(ranks, world):
    from zoo.models import ZOO

    for name, per_rank in _run(ranks, world, _names(refused=False, layout=str(world)), timeout=600).items():
        assert all(r["status"] == "ok" and r["err"] < ZOO[name].rtol for r in per_rank), (name, per_rank)


@pytest.mark.parametrize("world", [2, 3])
def test_zoo_refusals_raise_their_error_on_every_rank(ranks, world):
    """Each refusal runs alone (a failed exchange leaves messages posted: the next model must start afresh). Every
    rank raises at once, by design (the op's refusal, or a peer's notice that it failed in a domain op); the pool's
    timeout only bounds a hang."""
    from zoo.models import ZOO

    for name in _names(refused=True, layout=str(world)):
        per_rank = _run(ranks, world, [name], timeout=120)[name]
        expected = ZOO[name].refusal.split(" | ")  # alternatives: ranks holding different shards may fail at different checks
        assert all(r["status"] == "refused" and any(e in r["error"] for e in expected) for r in per_rank), (name, per_rank)


def test_zoo_models_equal_one_process_on_a_2x2_grid_of_blocks(ranks):
    """The same models on 2x2 blocks (their sharded dim and the next): tokens, channels-last LayerNorm, reduced-K/V
    attention by matmul, diffusers' attention blocks and the VAE's posterior chunk all run on blocks."""
    from zoo.models import ZOO

    for name, per_rank in _run(ranks, 4, _names(refused=False, layout="blocks"), timeout=600, grid=(2, 2)).items():
        assert all(r["status"] == "ok" and r["err"] < ZOO[name].rtol for r in per_rank), (name, per_rank)


def test_zoo_refusals_on_blocks_raise_on_every_rank(ranks):
    """What the models that slabs refuse do on blocks: a refusal naming the op (or the library's own shape check)
    on every rank, never a wrong answer or a hang."""
    named = ("has no rule for", "would mix the blocks' rows", "doesn't match model", "laid out differently",
             "only slices with a positive step are supported there")
    for name in _names(refused=True, layout="blocks"):
        per_rank = _run(ranks, 4, [name], timeout=120, grid=(2, 2))[name]
        assert all(r["status"] == "refused" and any(e in r["error"] for e in named) for r in per_rank), (name, per_rank)


def _run(ranks, world: int, names: list[str], timeout: int, grid: tuple[int, ...] | None = None) -> dict:
    results = ranks.run(world, _zoo_body, names, grid, timeout=timeout)
    report = {name: [r[name] for r in results] for name in names}
    print("\n".join(f"{world} ranks: {n}: {v}" for n, v in report.items()))
    return report
