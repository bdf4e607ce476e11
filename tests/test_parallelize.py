"""parallelize(model, plan) against the same model trained in one process on the global batch.

fp64 throughout the equivalence runs: AdamW's update divides by sqrt(v)+eps, so in fp32 a
gradient that cancels to ~1e-9 (summation-order noise of a different reduction tree) moves a
weight by ~1e-4 after one step. In fp64 that noise is ~1e-16, so rtol=1e-9 stays tight enough
to catch any real error (a wrong gradient scale or a missing reduction is off by >= 1e-2).
"""

from __future__ import annotations

import fnmatch

import torch

from mesh3d.mesh_shape import divisors

STEPS = 3
# atol 1e-10: the key bias gets an exactly-zero gradient in theory (softmax ignores it), so
# both runs see ~1e-17 noise there that AdamW turns into ~1e-11 moves; parameters are O(0.1).
RTOL, ATOL = 1e-9, 1e-10


def _train_pair(kind, plan_kwargs, steps=STEPS, per_rank=2, seed=0, dtype=torch.float64, tol=(RTOL, ATOL),
                exclude=()):
    """Train a parallelized model and a one-process copy side by side; return the max errors."""
    import torch.distributed as dist

    import parallel_models as pm
    from mesh3d import DistributedManager, Plan, parallelize

    dm = DistributedManager()
    B = dm.axis_size("batch")
    model, ref = pm.make(kind, seed, dtype=dtype)
    model_plan = pm.transformer_plan_model() if kind == "transformer" else pm.MLP_PLAN
    plan = Plan(model=model_plan if dm.axis_size("model") > 1 else {}, **plan_kwargs)
    model = parallelize(model, plan)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    b = dm.axis_rank("batch")
    worst = {"loss": 0.0, "param": 0.0}
    for step in range(steps):
        x, y = pm.batch_for(kind, B * per_rank, seed=100 + step, dtype=dtype)
        xs, ys = x[b * per_rank:(b + 1) * per_rank], y[b * per_rank:(b + 1) * per_rank]
        loss = pm.loss_sum(kind, model, xs, ys) / per_rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = pm.loss_sum(kind, ref, x, y) / (B * per_rank)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        seen = loss.detach().clone()
        dist.all_reduce(seen, group=dm.group("batch"))
        seen /= B
        torch.testing.assert_close(seen, ref_loss.detach(), rtol=tol[0], atol=tol[1], msg=lambda m: f"loss at step {step}: {m}")
        worst["loss"] = max(worst["loss"], abs(seen.item() - ref_loss.item()))
    got, want = pm.full_params(model), pm.full_params(ref)
    for name in want:
        if any(fnmatch.fnmatch(name, pattern) for pattern in exclude):
            continue
        torch.testing.assert_close(got[name], want[name], rtol=tol[0], atol=tol[1], msg=lambda m: f"parameter {name}: {m}")
        worst["param"] = max(worst["param"], (got[name] - want[name]).abs().max().item())
    return worst


def _equivalence_matrix(world, modes, kinds):
    """Every (batch, 1, model) shape of ``world`` × batch mode × model kind, in one body."""
    from mesh3d import DistributedManager

    torch.set_default_dtype(torch.float64)
    report = {}
    for model_size in divisors(world):
        DistributedManager.initialize(batch=world // model_size, domain=1, model=model_size)
        # batch=None leaves gradients unsynchronized over batch: one process only when batch is 1.
        for mode in [m for m in modes if m is not None or world == model_size]:
            for kind in kinds:
                key = (world // model_size, model_size, mode, kind)
                try:
                    report[key] = _train_pair(kind, {"batch": mode})
                except AssertionError as err:
                    raise AssertionError(f"(batch, model, mode, kind)={key}: {err}") from None
        DistributedManager.shutdown()
    return report


def _run_matrix(ranks, world, kinds=("transformer", "mlp")):
    results = ranks.run(world, _equivalence_matrix, world, ["fsdp", "hsdp", "ddp", None], list(kinds), timeout=300)
    cases = results[0]
    assert len(cases) == (len(divisors(world)) * 3 + 1) * len(kinds)
    assert all(r == cases for r in results), "ranks disagree on the errors they measured"


def test_equivalence_world_1_and_2(ranks):
    _run_matrix(ranks, 1)
    _run_matrix(ranks, 2)


def test_equivalence_world_4(ranks):
    _run_matrix(ranks, 4)


def test_equivalence_world_8(ranks):
    """Every (batch, 1, model) mesh of 8 ranks x FSDP, HSDP, DDP and none, on the transformer, trains as one process
    (fp64), every rank measuring the same errors.

    NOTE: the transformer only, which holds the MLP's styles (a colwise then a rowwise Linear, replicated layers
    around them) and more; the MLP trains on every mesh of 1, 2 and 4 ranks above. On 8 ranks sharing 2 cores it took
    about 40 % of this test's 95 s (AVX2-only EPYC)."""
    _run_matrix(ranks, 8, ("transformer",))


def _fp32_cases():
    """The issue's fp32 bar (rtol 1e-4) on FSDP+TP and HSDP+TP, both models, AdamW default eps.

    The attention KEY bias is left out of the parameter comparison: softmax ignores it, so its
    true gradient is exactly 0 and both runs see only fp32 rounding noise (~1e-9), which AdamW
    normalizes into lr-sized random moves (0.8 relative here). Its fp64 comparison above is tight.
    """
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=2, domain=1, model=2)
    return {(mode, kind): _train_pair(kind, {"batch": mode}, dtype=torch.float32, tol=(1e-4, 1e-5),
                                          exclude=("layers.*.attn.wk.bias",))
            for mode in ("fsdp", "hsdp") for kind in ("transformer", "mlp")}


def test_equivalence_fp32_at_issue_tolerance(ranks):
    results = ranks.run(4, _fp32_cases, timeout=120)
    assert len(results[0]) == 4
