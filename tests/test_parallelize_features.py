"""parallelize beyond the plain matrix: the domain gradient rule, uneven batches, clipping, mixed
precision, activation checkpointing, CPU offload, mesh-independent init and explain.

Equivalence runs use fp64 (see test_parallelize.py for why) except mixed precision, which is
compared with the fp32 one-process run at bf16-sized tolerances.
"""

from __future__ import annotations

import torch

RTOL, ATOL = 1e-9, 1e-10


def _token_run(shape, mode, counts, token_splits, steps=3, clip=None):
    """MLP on (samples, tokens, features): batch ranks hold ``counts[b]`` samples, domain ranks
    ``token_splits[d]`` tokens of each. Loss = mean over ALL tokens; each rank contributes its
    part through global_mean_loss, so gradients must be averaged over batch and summed over domain."""
    import torch.distributed as dist

    import parallel_models as pm
    from mesh3d import DistributedManager, Plan, clip_grad_norm_, global_mean_loss, parallelize

    dm = DistributedManager.initialize(*shape)
    model, ref = pm.make("mlp", seed=3)
    plan = Plan(model=pm.MLP_PLAN if shape[2] > 1 else {}, batch=mode)
    model = parallelize(model, plan)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    b, d = dm.axis_rank("batch"), dm.axis_rank("domain")
    s0, t0 = sum(counts[:b]), sum(token_splits[:d])
    tokens = sum(token_splits)
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(sum(counts), tokens, pm.DIM, generator=g)
        y = torch.randn(sum(counts), tokens, 4, generator=g)
        xs, ys = x[s0:s0 + counts[b], t0:t0 + token_splits[d]], y[s0:s0 + counts[b], t0:t0 + token_splits[d]]
        local_sum = ((model(xs) - ys) ** 2).mean(-1).sum()
        loss = global_mean_loss(local_sum, xs.shape[0] * xs.shape[1])
        loss.backward()
        ref_loss = ((ref(x) - y) ** 2).mean(-1).mean()
        ref_loss.backward()
        if clip is not None:
            norms.append((clip_grad_norm_(model.parameters(), clip).item(),
                          torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        seen = loss.detach().clone()
        dist.all_reduce(seen, group=dm.group("batch_domain"))
        seen /= dm.axis_size("batch")
        torch.testing.assert_close(seen, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    for name, want in pm.full_params(ref).items():
        torch.testing.assert_close(pm.full(dict(model.named_parameters())[name]), want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{shape} {mode} {name}: {m}")
    for got, want in norms:
        assert abs(got - want) <= 1e-9 * want, (got, want)
    DistributedManager.shutdown()
    return norms


def _domain_cases(world):
    torch.set_default_dtype(torch.float64)
    done = []
    shapes = {4: [(2, 2, 1), (1, 4, 1)], 8: [(2, 2, 2)]}[world]
    for shape in shapes:
        counts = [1 + i for i in range(shape[0])]                       # uneven samples per batch rank
        splits = [2 + (i % 2) for i in range(shape[1])]                  # uneven tokens per domain rank
        for mode in ("fsdp", "hsdp", "ddp"):
            _token_run(shape, mode, counts, splits)
            done.append((shape, mode))
    return done


def test_gradients_average_over_batch_and_sum_over_domain_with_uneven_sizes(ranks):
    """domain > 1 on gloo, uneven samples per batch rank and uneven tokens per domain rank."""
    assert len(ranks.run(4, _domain_cases, 4, timeout=200)[0]) == 6
    assert len(ranks.run(8, _domain_cases, 8, timeout=200)[0]) == 3


def _clip_cases():
    """Clipping active at every step (max_norm far below the norm) on meshes that mix plain
    tensors with TP DTensors (batch=None), FSDP DTensors, and FSDP+TP 2-D DTensors."""
    import parallel_models as pm
    from mesh3d import DistributedManager, Plan, clip_grad_norm_, parallelize

    torch.set_default_dtype(torch.float64)
    out = []
    for shape, mode in (((1, 1, 4), None), ((4, 1, 1), "fsdp"), ((2, 1, 2), "fsdp"), ((2, 1, 2), "hsdp")):
        dm = DistributedManager.initialize(*shape)
        model, ref = pm.make("transformer", seed=5)
        model = parallelize(model, Plan(model=pm.transformer_plan_model() if shape[2] > 1 else {}, batch=mode))
        kinds = {type(p).__name__ for p in model.parameters()}
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
        B, b = shape[0], dm.axis_rank("batch")
        for step in range(3):
            x, y = pm.batch_for("transformer", 2 * B, seed=step)
            (pm.loss_sum("transformer", model, x[2 * b:2 * b + 2], y[2 * b:2 * b + 2]) / 2).backward()
            (pm.loss_sum("transformer", ref, x, y) / (2 * B)).backward()
            got = clip_grad_norm_(model.parameters(), 0.1)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            assert want > 0.5, "clipping must be active for the test to mean anything"
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        for name, want in pm.full_params(ref).items():
            torch.testing.assert_close(pm.full(dict(model.named_parameters())[name]), want, rtol=RTOL, atol=ATOL)
        out.append((shape, mode, sorted(kinds)))
        DistributedManager.shutdown()
    return out


def test_clip_grad_norm_over_mixed_meshes_matches_one_process(ranks):
    results = ranks.run(4, _clip_cases, timeout=200)
    assert results[0][0][2] == ["DTensor", "Parameter"]  # the "mixed torch.Tensor and DTensor" case


def _precision_offload_checkpoint():
    """Mixed precision (bf16 compute, fp32 reduce) vs fp32 one process; AC, CPU offload and the
    "replicate" style in fp64, exact."""
    import parallel_models as pm
    from torch.distributed._composable.contract import _get_registry

    from mesh3d import DistributedManager, Plan, parallelize

    dm = DistributedManager.initialize(2, 1, 2)
    report = {}
    for name, kwargs, dtype, tol in (
        ("bf16", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), torch.float32, (2e-2, 2e-3)),
        ("checkpoint", dict(checkpoint=["layers.*"]), torch.float64, (RTOL, ATOL)),
        ("offload", dict(cpu_offload=True), torch.float64, (RTOL, ATOL)),
        ("replicate_style", dict(extra={"layers.*.ln[12]": "replicate", "norm": "replicate"}), torch.float64, (RTOL, ATOL)),
        ("sequence_parallel", dict(styles="sequence"), torch.float64, (RTOL, ATOL)),
    ):
        torch.set_default_dtype(dtype)
        model, ref = pm.make("transformer", seed=9, dtype=dtype)
        styles = {**pm.transformer_plan_model(), **kwargs.pop("extra", {})}
        if kwargs.pop("styles", None) == "sequence":
            styles = pm.sequence_parallel_plan()
        model = parallelize(model, Plan(model=styles, **kwargs))
        if name == "replicate_style":  # LayerNorm weights: Replicate on the model axis, FSDP-sharded on batch
            from torch.distributed.tensor import Replicate

            placements = model.norm.weight.placements
            assert model.norm.weight.device_mesh.ndim == 2 and isinstance(placements[1], Replicate), placements
        seen_seq = []
        model.layers[0].ln1.register_forward_hook(
            lambda mod, inp, out: seen_seq.append(getattr(inp[0], "_local_tensor", inp[0]).shape[1]))
        if name == "checkpoint":
            assert all("checkpoint" in _get_registry(model.layers[i]) for i in range(2))
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
        b, worst = dm.axis_rank("batch"), 0.0
        for step in range(3):
            x, y = pm.batch_for("transformer", 4, seed=step)
            (pm.loss_sum("transformer", model, x[2 * b:2 * b + 2], y[2 * b:2 * b + 2]) / 2).backward()
            (pm.loss_sum("transformer", ref, x, y) / 4).backward()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        # Sequence parallelism: the norm sees a sequence shard (local tensor), the others the whole sequence.
        assert set(seen_seq) == {pm.SEQ // 2 if name == "sequence_parallel" else pm.SEQ}, (name, seen_seq)
        for pname, want in pm.full_params(ref).items():
            got = pm.full(dict(model.named_parameters())[pname])
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1], msg=lambda m: f"{name} {pname}: {m}")
            worst = max(worst, (got - want).abs().max().item())
        report[name] = worst
    return report


def test_mixed_precision_activation_checkpointing_and_cpu_offload(ranks):
    report = ranks.run(4, _precision_offload_checkpoint, timeout=200)[0]
    assert report["bf16"] > 0, "bf16 compute should differ from fp32 somewhere (else it was not applied)"


def _init_across_shapes(world):
    """Meta model + seed: full weights on every mesh shape, and from the one-process path."""
    import parallel_models as pm
    from mesh3d import DistributedManager, Plan, parallelize
    from mesh3d.parallel.init import capture_init_specs, materialize
    from mesh3d.mesh_shape import divisors

    with torch.device("meta"):
        plain = pm.Transformer()
    materialize(plain, capture_init_specs(plain), seed=7, init_fn=None, device=torch.device("cpu"))
    reference = pm.full_params(plain)
    shapes = [(world // m, 1, m) for m in divisors(world)] + ([(2, 2, 2)] if world == 8 else [])
    for shape in shapes:
        for mode in ("fsdp", "hsdp"):  # ddp holds whole tensors: the trivial case
            DistributedManager.initialize(*shape)
            with torch.device("meta"):
                model = pm.Transformer()
            model = parallelize(model, Plan(model=pm.transformer_plan_model() if shape[2] > 1 else {}, batch=mode), seed=7)
            got = pm.full_params(model)
            for name, want in reference.items():
                assert torch.equal(got[name], want), (shape, mode, name)
            DistributedManager.shutdown()
    # seed= on a model that is already materialized re-initializes it the same way.
    DistributedManager.initialize(world // 2, 1, 2)
    model = parallelize(pm.Transformer(), Plan(model=pm.transformer_plan_model()), seed=7)
    assert all(torch.equal(pm.full(p), reference[n]) for n, p in model.named_parameters())
    DistributedManager.shutdown()
    # The weights look like reset_parameters() made them, and differ between layers.
    bound = 1 / pm.DIM**0.5
    w = reference["layers.0.attn.wq.weight"]
    assert w.abs().max() <= bound and w.std() > bound / 4
    assert not torch.equal(w, reference["layers.1.attn.wq.weight"])
    assert torch.equal(reference["norm.weight"], torch.ones(pm.DIM))
    return len(shapes)


def test_mesh_independent_init_is_bitwise_equal_on_every_shape(ranks):
    assert ranks.run(8, _init_across_shapes, 8, timeout=200)[0] == 5
    assert ranks.run(2, _init_across_shapes, 2, timeout=100)[0] == 2


def test_explain_table_and_cli(capsys):
    import parallel_models as pm

    from mesh3d import Plan
    from mesh3d.cli import main
    from mesh3d.parallel.explain import explain_rows

    model, _ = pm.make("transformer", dtype=torch.float32)
    plan = Plan(model=pm.transformer_plan_model(), checkpoint=["layers.1"])
    rows = {r["module"]: r for r in explain_rows(plan, model, {"batch": 2, "domain": 1, "model": 2})}
    up = rows["layers.0.mlp.up"]
    assert up["model"] == "colwise: weight Shard(0)" and up["unit"] == "layers.0"
    # up: weight (32, 16) + bias (32) fp32, halved by the model axis then by FSDP over 2 ranks.
    assert up["bytes_per_rank"] == (32 * 16 + 32) * 4 // 4
    assert rows["layers.1.ln1"]["checkpointed"] == "yes" and rows["layers.0.ln1"]["checkpointed"] == ""
    assert rows["norm"]["model"] == "Replicate" and rows["norm"]["unit"] == "<root>"
    assert main(["explain", "parallel_models:Transformer", "parallel_models:example_plan", "--batch", "2", "--model", "2"]) == 0
    out = capsys.readouterr().out
    assert "layers.1.mlp.down" in out and "rowwise: weight Shard(1)" in out and "TOTAL" in out
