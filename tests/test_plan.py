"""``mesh3d plan`` in one process: meshes, rank classes against every rank simulated, scaling, refusals, warnings.

What it predicts is held to real runs in tests/test_plan_reality.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from domain_models import TinyUNet
from plan_models import ConvStack, Flips, WideKernel, transformer

from mesh3d import Plan
from mesh3d.domain import attention_mode
from mesh3d.domain.attention import ring
from mesh3d.planner import InputSpec, JobMesh, plan_job
from mesh3d.planner.classes import DomainClasses
from mesh3d.planner.job import _factors
from mesh3d.planner.layout import ModelLayout
from mesh3d.planner.meta_outputs import MetaOutputs
from mesh3d.planner.simulate import Simulator


def test_meshes_resolve_and_parse_like_the_manager():
    assert JobMesh.resolve(4096, batch=-1, domain=(4, 4), model=4) == JobMesh(64, (4, 4), 4)
    assert JobMesh.parse("batch=8,domain=4x4,model=2") == JobMesh(8, (4, 4), 2) == JobMesh.parse("8,4x4,2")
    mesh = JobMesh(2, (3,), 2)
    assert [mesh.coords(r) for r in (0, 1, 2, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 2, 1)]
    assert all(mesh.rank_of(*mesh.coords(r)) == r for r in range(mesh.world))
    with pytest.raises(ValueError, match="grids of the 4 domain ranks that fit"):
        JobMesh.resolve(8, batch=2, domain=(2, 3))
    with pytest.raises(ValueError, match="unknown axis 'pipe'"):
        JobMesh.parse("pipe=2")


def _every_rank(model_factory, plan, mesh, inputs):
    """The simulation of every domain index, without classes."""
    with torch.device("meta"):
        model = model_factory()
    layout = ModelLayout.build(model, plan, mesh)
    sim = Simulator(model, plan, layout, inputs, device="cpu")
    try:
        return [sim.run(d) for d in range(mesh.domain)]
    finally:
        sim.close()


@pytest.mark.parametrize("mesh, inputs", [
    (JobMesh(1, (7,), 1), InputSpec((1, 2, 44, 10), sizes=((8, 8, 8, 8, 4, 4, 4),))),
    (JobMesh(1, (6,), 1), InputSpec((1, 2, 12, 10))),  # shards of 2 rows: halos reach two ranks away
    (JobMesh(1, (2, 4), 1), InputSpec((1, 2, 16, 24), sizes=((10, 6), (6, 6, 6, 6)))),
])
def test_one_rank_per_class_gives_every_rank_s_figures(mesh, inputs):
    """The classes keyed in mesh3d.planner.classes behave alike: simulated one by one, every member of a class
    has its representative's peak memory, domain bytes and messages."""
    everyone = _every_rank(TinyUNet, Plan(batch=None), mesh, inputs)
    with torch.device("meta"):
        model = TinyUNet()
    dims, sizes = inputs.layout(mesh.grid)
    classes = DomainClasses(mesh.grid, sizes, _factors(model, inputs, dims))
    radius = max(1, max(s.reach for s in everyone))
    reps = classes.representatives(radius)
    assert len(reps) < mesh.domain  # the point: fewer simulations than ranks
    for d, rep in enumerate(classes.class_of()):
        a, b = everyone[d], everyone[rep]
        assert (a.peak, a.domain_bytes, a.domain_messages) == (b.peak, b.domain_bytes, b.domain_messages), (d, rep)


def test_bytes_per_rank_fall_as_one_over_the_shard_degree():
    """Parameters, gradients and optimizer state over FSDP's degree, TP-sharded parameters over the model axis,
    and the input and halo-free activations over the domain axis."""
    def planned(world, batch, domain, model, styles=None):
        return plan_job(transformer if styles else lambda: ConvStack(width=16, depth=2, channels=16),
                        Plan(model=styles or {}), JobMesh.resolve(world, batch, domain, model),
                        InputSpec((2, 64) if styles else (1, 16, 64, 8), torch.int64 if styles else torch.float32,
                                  dims=(1,) if styles else None), optimizer="adamw")

    one = planned(1, 1, 1, 1).classes[0].memory
    steps = 4 * len(list(ConvStack(width=16, depth=2, channels=16).parameters()))  # AdamW's step counters: not sharded
    for s in (2, 4, 8, 16):  # FSDP over batch: every parameter's dim 0 is a multiple of 16
        m = planned(s, s, 1, 1).classes[0].memory
        assert (m["params"] * s, m["grads"] * s) == (one["params"], one["grads"])
        assert (m["optimizer"] - steps) * s == one["optimizer"] - steps
    for d in (2, 4, 8):
        assert planned(d, 1, d, 1, ).classes[0].memory["input"] * d == one["input"]
    tp1 = planned(1, 1, 1, 1, styles=_TP).classes[0].memory["params"]
    tp2 = planned(2, 1, 1, 2, styles=_TP).classes[0].memory["params"]
    sharded = sum(math.prod(p.shape) * 4 for n, p in transformer().named_parameters()
                  if any(k in n for k in ("tok.", "attn.w", "mlp.up", "mlp.down", "head.weight", "head.bias"))
                  and not n.endswith(("wo.bias", "down.bias")))
    assert tp1 - tp2 == sharded // 2


_TP = {"tok": "rowwise", "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
       "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise", "head": "colwise"}


def test_4096_ranks_on_a_3d_mesh_plan_with_few_simulations():
    """No timing here (scripts/bench_plan.py measures it): the plan covers every rank once and simulates a handful."""
    job = plan_job(lambda: ConvStack(width=16, depth=2), Plan(), JobMesh.resolve(4096, batch=-1, domain=(4, 4), model=1),
                   InputSpec((1, 2, 256, 256)), to=JobMesh.parse("128,4x4,1"))
    assert sum(c.count for c in job.classes) == 4096
    assert job.simulated_ranks <= 9  # edges and interior along each grid dim
    assert job.checkpoint["writers"] > 0 and job.reshard is not None and job.reshard["bytes_read"] >= job.reshard["bytes_needed"]


def test_ops_without_a_domain_rule_are_named_as_the_dispatcher_names_them():
    job = plan_job(Flips, Plan(batch=None), JobMesh.resolve(2, 1, 2, 1), InputSpec((1, 2, 8, 8)))
    assert set(job.refused) == {"torch.renorm", "torch.msort"}
    assert "torch.renorm has no domain rule" in job.refused["torch.renorm"] \
        and ".full_tensor()" in job.refused["torch.renorm"]
    assert "torch.renorm would be refused" in job.table()


def test_shards_thinner_than_a_halo_and_device_memory_are_warned():
    job = plan_job(WideKernel, Plan(batch=None), JobMesh.resolve(8, 1, 8, 1), InputSpec((1, 1, 16, 64)),
                   device_memory=1000)
    text = "\n".join(job.warnings)
    assert "torch.conv2d: domain ranks read halo rows from ranks up to 2 grid steps away" in text  # 2-row shards, halo 3
    assert "need more than the 1000 B of device memory" in text


def test_a_plan_that_does_not_fit_the_model_raises_as_parallelize_would():
    with pytest.raises(ValueError, match="does not divide it; model axis sizes that would work"):
        plan_job(transformer, Plan(model={"layers.*.attn.wq": "colwise"}), JobMesh.resolve(3, 1, 1, 3),
                 InputSpec((1, 8), torch.int64, dims=(1,)))
    with pytest.raises(ValueError, match="the step fails on domain rank 0 of batch 1 x domain 1 x model 2"):
        plan_job(transformer, Plan(model={"layers.*.mlp.up": "colwise"}), JobMesh.resolve(2, 1, 1, 2),
                 InputSpec((1, 8), torch.int64, dims=(1,)))  # no rowwise partner: the next Linear gets half its input


def test_the_command_line_prints_tables_for_people_and_json_for_tools(capsys):
    from mesh3d.cli import main

    args = ["plan", "plan_models:conv_stack", "--world", "16", "--domain", "2x2", "--input", "1x2x32x16", "--to", "2,2,1"]
    assert main(args + ["--device-memory", "100KiB"]) == 0
    table = capsys.readouterr().out
    assert "memory per rank" in table and "checkpoint:" in table and "load onto batch 2 x domain 2 x model 1" in table
    assert "need more than the 100.0 KiB of device memory" in table
    assert main(args + ["--json"]) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["world"] == 16 and sum(c["count"] for c in job["classes"]) == 16
    assert job["reshard"]["bytes_needed"] > 0 and job["checkpoint"]["files"] == 2 * job["checkpoint"]["writers"]
    assert main(["plan", "plan_models:conv_stack", "--domain", "-1", "--input", "1x2x32x16"]) == 2
    assert "mesh3d plan: error: give --world N (the batch axis, -1 by default, is inferred from it)" in capsys.readouterr().err


def test_attention_is_planned_as_the_fused_kernel_and_recomputation_sees_it_too():
    """On meta, SDPA decomposes into its math form and keeps the (queries x keys) scores; devices run a fused kernel.
    Activation checkpointing recomputes in backward, where torch's function modes are off: the plan enters them
    again there, else the recomputation would take the other path and torch would refuse it."""
    def peak(plan, device):
        job = plan_job(lambda: transformer(), plan, JobMesh.resolve(1, 1, 1, 1), InputSpec((1, 4096), torch.int64, (1,)),
                       device=device)
        return job.classes[0].memory["step_peak"]

    scores = 4096 * 4096 * 4 * 4  # one layer's fp32 scores, 4 heads
    for device in ("cpu", "cuda"):
        plain, recomputed = peak(Plan(), device), peak(Plan(checkpoint=["layers.*"]), device)
        assert plain < scores / 4 and recomputed < plain, (device, plain, recomputed)


@pytest.mark.parametrize("grid, expected_rows", [((2,), lambda h, w: w), ((2, 2), lambda h, w: h // 2 + w // 2 + 1)])
def test_planned_halo_bytes_are_the_geometric_minimum(grid, expected_rows):
    """A 'same' 3x3 conv: one row to the slab neighbour; on 2x2 blocks a row, a column and a corner (mesh3d's
    halo planner sends exactly that; the plan counts its exchanges)."""
    c, h, w = 3, 12, 10
    job = plan_job(lambda: nn.Conv2d(c, c, 3, padding=1), Plan(batch=None), JobMesh.resolve(math.prod(grid), 1, grid, 1),
                   InputSpec((1, c, h, w)))
    assert all(k.domain["by_op"]["torch.conv2d"] == c * expected_rows(h, w) * 4 for k in job.classes)


@pytest.mark.parametrize("domain, tokens", [(2, 13), (3, 22), (4, 9)])
def test_modeled_ring_attention_plans_what_the_computed_ring_does(monkeypatch, domain, tokens):
    """A dry run models ring attention per pass (buffers, its largest kernel workspace, every exchange) instead of
    running each block's kernels: the same domain bytes and messages as computing it, and a step peak no lower
    (the arriving buffer is held at its largest for the whole pass) and within 5 %, with no block kernel run.
    Planned with CPU kernels: the CUDA allocator's 512-byte rounding of a tiny model's many small tensors is not
    what this compares."""
    def planned():
        with attention_mode("ring"):
            job = plan_job(transformer, Plan(batch=None), JobMesh.resolve(domain, 1, domain, 1),
                           InputSpec((2, tokens), torch.int64, (1,)), device="cpu")
        return [(c.domain["bytes"], c.domain["messages"], c.memory["step_peak"]) for c in job.classes]

    def no_block_kernels(*args, **kwargs):
        raise AssertionError("a dry run of ring attention ran a block kernel: planning a long sequence would crawl")

    stats = ring.RING_STATS
    stats.reset()
    with monkeypatch.context() as patched:
        patched.setattr(ring, "block_forward", no_block_kernels)
        patched.setattr(ring, "block_backward", no_block_kernels)
        modeled = planned()
    modeled_messages = stats.messages
    monkeypatch.setattr(ring, "_modeled", lambda mask: False)
    stats.reset()
    computed = planned()
    assert stats.messages == modeled_messages > 0
    for (m_bytes, m_msgs, m_peak), (c_bytes, c_msgs, c_peak) in zip(modeled, computed, strict=True):
        assert (m_bytes, m_msgs) == (c_bytes, c_msgs)
        assert c_peak <= m_peak <= 1.05 * c_peak, (m_peak, c_peak)


def test_meta_outputs_reuse_only_pure_ops_and_give_their_metadata():
    """The planner's cache of meta outputs: the same shape, strides and dtype as the op, a fresh storage each time;
    views, in-place ops and ops on other devices run as they are."""
    outputs = MetaOutputs()
    a = torch.empty(3, 1, 5, device="meta").transpose(0, 2)
    b = torch.empty(4, 1, dtype=torch.float64, device="meta")
    same_shape = torch.empty(5, 1, 3, device="meta")  # as ``a``, other strides: a different output layout
    calls = [(torch.ops.aten.mul.Tensor, (a, b)), (torch.ops.aten.mul.Tensor, (same_shape, b)),
             (torch.ops.aten.cat.default, ([b, b], 1)),
             (torch.ops.aten.sum.dim_IntList, (a, [0], True)), (torch.ops.aten.pow.Tensor_Scalar, (b, 2))]
    for func, args in calls:
        first, again, direct = outputs.call(func, args, {}), outputs.call(func, args, {}), func(*args)
        for got in (first, again):
            assert (got.shape, got.stride(), got.dtype, got.device) == (direct.shape, direct.stride(), direct.dtype,
                                                                        direct.device), func
        assert first.untyped_storage()._cdata != again.untyped_storage()._cdata
    view = outputs.call(torch.ops.aten.transpose.int, (b, 0, 1), {})
    assert view.untyped_storage()._cdata == b.untyped_storage()._cdata
    assert outputs.call(torch.ops.aten.add_.Tensor, (b, b), {}) is b
    cpu = torch.ones(2)
    assert torch.equal(outputs.call(torch.ops.aten.mul.Tensor, (cpu, cpu), {}), cpu)


def test_thin_shard_warning_names_halos_not_attention_relayouts():
    """A 5x5 conv on 1-row shards reads rows two ranks away: warned. Causal ring attention moves rows to far ranks
    on purpose (its zigzag layout), forward and backward: not warned."""
    conv = plan_job(lambda: nn.Conv2d(2, 2, 5, padding=2), Plan(batch=None), JobMesh.resolve(6, 1, 6, 1),
                    InputSpec((1, 2, 6, 8)))
    assert any("torch.conv2d: domain ranks read halo rows from ranks up to 2 grid steps" in w for w in conv.warnings)
    with attention_mode("ring"):
        ring = plan_job(transformer, Plan(batch=None), JobMesh.resolve(6, 1, 6, 1), InputSpec((2, 24), torch.int64, (1,)))
    assert not any("grid steps away" in w for w in ring.warnings), ring.warnings


def test_the_peak_is_the_sum_of_its_parts_optimizer_state_included():
    """One rank: the peak is the parameters, the optimizer state, the buffers, the input and the step's own peak, each
    counted from the model and the input here (AdamW: two fp32 moments per element and a step counter per tensor)."""
    def model():
        return ConvStack(width=16, depth=2, channels=16)

    shape = (1, 16, 64, 8)
    params = list(model().parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model().buffers())
    jobs = {opt: plan_job(model, Plan(), JobMesh.resolve(1, 1, 1, 1), InputSpec(shape), optimizer=opt).classes[0].memory
            for opt in ("none", "sgd", "adamw")}
    adam_state = 2 * param_bytes + 4 * len(params)
    assert jobs["adamw"]["optimizer"] == adam_state and jobs["none"]["optimizer"] == 0
    for opt, m in jobs.items():
        assert m["params"] == param_bytes and m["buffers"] == buffer_bytes and m["input"] == math.prod(shape) * 4
        assert m["step_peak"] == jobs["none"]["step_peak"] > 0          # the step does not depend on the optimizer
        assert m["peak"] == param_bytes + m["optimizer"] + buffer_bytes + m["input"] + m["step_peak"], opt
    assert jobs["adamw"]["peak"] - jobs["none"]["peak"] == adam_state
