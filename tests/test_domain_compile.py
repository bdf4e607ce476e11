"""``torch.compile`` of models called with domain tensors: equal to one process, one graph, no recompiles.

Each body trains the same model three Adam steps (fp64, tolerance 1e-9: Adam's sqrt(v) would turn summation-order
noise into a visible step, torch_pitfalls.md) three ways on every rank: in one process on the whole tensor, eagerly
on domain shards and compiled on domain shards. It checks losses, raw gradients (domain-summed) before every step
and the parameters after the last one, and counts Dynamo frames: a frame compiled after the first step is a
recompile. ``fullgraph=True`` where the graph must be whole: a graph break then raises.

Compiling is slow on two cores: the models are the small ones of ``domain_models``, Inductor runs where the issue
asks for it (one rank, and the U-Net at D=2), on the ViT under ``Plan(compile=...)`` with FSDP and TP (where it
found two bugs ``aot_eager`` did not), and ``aot_eager`` (the same Dynamo graph and AOTAutograd joint graph, without
code generation) elsewhere.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from domain_cases import domain_sum, domain_sums, max_err, shard_sizes, sum_grads_over_domain, with_edge_layouts
from domain_compose import compose_body
from domain_models import H, W, GridAttention, GridViT, TinyUNet, TinyViT
from mesh3d import DistributedManager, domain
from mesh3d.domain.dispatch.compile_guards import IDENTITY_GUARDS
from mesh3d.domain.dispatch.nesting import NestedDispatchCheck
from mesh3d.domain.core.settings import SETTINGS
from profiles import examples

STEPS = 3


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return {"unet": TinyUNet, "vit": TinyViT, "tokens": GridAttention}[kind]().double()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _train_compiled_body(kind: str, sizes, backend: str, fullgraph: bool, grid: tuple[int, int] | None = None,
                         filtered: bool = False, mode: str | None = None):
    DistributedManager.initialize(batch=1, domain=grid or -1)
    ref = _model(kind)
    eager, compiled = copy.deepcopy(ref), copy.deepcopy(ref)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, eager, compiled)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, H, W, generator=g, dtype=torch.float64)
    y = torch.randn(2, 3, generator=g, dtype=torch.float64) if kind == "vit" else \
        torch.randn(2, 2, H, W, generator=g, dtype=torch.float64)
    where = {"dims": (2, 3)} if grid else {"dim": 2}
    counter = CompileCounterWithBackend(backend)

    def model_and_loss(model):
        return lambda xs, ys: _loss(model(xs), ys)

    # NOTE: the whole step (model and loss) is one compiled function, as a user's compiled training step would be.
    options = {"guard_filter_fn": domain.guard_filter} if filtered else None
    compiled_step = torch.compile(model_and_loss(compiled), backend=counter, fullgraph=fullgraph, options=options)
    errs, frames_after_first = [], None
    # the mode every attention runs in, eager and compiled (read when the graph runs); reset even if a step fails,
    # as the rank goes on to other tests
    with domain.attention_mode(mode) if mode is not None else contextlib.nullcontext():
        for i in range(STEPS):
            xs = domain.shard(x, sizes=sizes, **where)
            ys = y if kind == "vit" else domain.shard(y, sizes=sizes, **where)
            losses = []
            for model, opt, run in ((ref, opts[0], lambda: _loss(ref(x), y)),
                                    (eager, opts[1], lambda: _loss(eager(xs), ys)),
                                    (compiled, opts[2], lambda: compiled_step(xs, ys))):
                opt.zero_grad()
                loss = run()
                loss.backward()
                if model is not ref:
                    sum_grads_over_domain(model.parameters())
                losses.append(float(loss.detach().to_local() if isinstance(loss, domain.DomainTensor) else loss.detach()))
            errs.append(max(abs(a - losses[0]) for a in losses[1:]))
            errs.extend(max(max_err(p.grad, q.grad) for p, q in zip(ref.parameters(), m.parameters()))
                        for m in (eager, compiled))
            for opt in opts:
                opt.step()
            if i == 0:
                frames_after_first = counter.frame_count
    param_err = max(max_err(p, q) for m in (eager, compiled) for p, q in zip(ref.parameters(), m.parameters()))
    return max(errs), param_err, frames_after_first, counter.frame_count


def _check(results, frames: int | None = 1) -> None:
    for err, param_err, first, last in results:
        assert err < 1e-9 and param_err < 1e-9
        assert last == first, f"recompiled after the first step: {first} frame(s), then {last}"
        if frames is not None:
            assert first == frames


# NOTE: aot_eager for both (issue 63): at D=1 the subject is what Dynamo and AOTAutograd trace (one graph, no break, no
# recompile); Inductor's code for a plain U-Net is Inductor's own, and Inductor compiles the U-Net's halo exchanges
# in test_sharded_unet_compiles_whole_and_trains_as_one_process[D2-inductor] (79 s of a loaded run here before).
@pytest.mark.parametrize(("kind", "backend"), [("unet", "aot_eager"), ("vit", "aot_eager")])
def test_one_rank_compiles_to_one_graph_equal_to_one_process(ranks, kind, backend):
    """D=1: the model and loss are one graph (fullgraph: no break), compiled once, and train as one process."""
    _check(ranks.run(1, _train_compiled_body, kind, None, backend, True, timeout=300))


@pytest.mark.parametrize(("world", "sizes", "backend"), [(2, (9, 5), "inductor"), (3, (8, 6, 0), "aot_eager")],
                         ids=["D2-inductor", "D3-empty-shard"])
def test_sharded_unet_compiles_whole_and_trains_as_one_process(ranks, world, sizes, backend):
    """D=2 and D=3 (uneven, one empty shard): every halo exchange is in the graph (fullgraph), no recompiles; with
    ``domain.guard_filter`` (the documented recipe), as without it at D=1."""
    _check(ranks.run(world, _train_compiled_body, "unet", sizes, backend, True, None, True, timeout=300))


def _guard_filter_body(wrapper=False):
    from mesh3d.domain.core.wrapped import wrapper_tensors

    with wrapper_tensors(wrapper):
        return _guard_filter_run()


def _guard_filter_run():
    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    model = TinyUNet().double()
    x = torch.randn(2, 2, H, W, dtype=torch.float64)
    decided: list = []

    def recording(entries):
        keep = domain.guard_filter(entries)
        decided.extend((e.name, e.guard_type, e.is_global, k) for e, k in zip(entries, keep))
        return keep

    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda xs: model(xs).square().mean(), backend=counter, options={"guard_filter_fn": recording})
    xs = domain.shard(x, dim=2)
    results = [float(step(xs).to_local())]
    with domain.window_overlap(not SETTINGS.value.overlap.enabled):  # a setting the graph read: it must recompile
        results.append(float(step(xs).to_local()))
    results.append(float(step(xs).to_local()))
    return decided, counter.frame_count, results, float(model(x).square().mean())


def test_guard_filter_drops_only_guards_on_mesh3d_code(ranks):
    """The guards ``domain.guard_filter`` drops are identity guards on mesh3d's own code (modules, functions, code
    objects, builtins) and on the torch internals tracing it reads (Dynamo's polyfills); guards on the input, its
    spec, tensors, global state and mesh3d's settings stay: toggling ``window_overlap`` still recompiles, and the
    results equal eager."""
    (decided, frames, results, eager), = ranks.run(1, _guard_filter_body, False, timeout=300)
    dropped = [(name, kind) for name, kind, _, keep in decided if not keep]
    kept = [(name, kind) for name, kind, _, keep in decided if keep]
    assert len(dropped) > 200, (len(dropped), len(kept))  # two graphs' worth of guards on mesh3d's own code
    mesh3d_code = ("mesh3d", "__builtins_dict", "_spec", "__subclass_DomainTensor")
    torch_internals = ("__import_torch_dot__dynamo_dot_polyfills", "__import_torch_dot__tensor", "_tuple_new",
                       "___unnamed_scope")
    assert all(any(part in name for part in mesh3d_code + torch_internals) for name, _ in dropped), dropped
    internal = [(name, kind) for name, kind in dropped if any(part in name for part in torch_internals)]
    assert internal and all(kind in IDENTITY_GUARDS for _, kind in internal), internal
    assert not any("__import_torch_dot__dynamo_dot_polyfills" in name for name, _ in kept), kept
    assert not any(kind in ("TENSOR_MATCH", "GLOBAL_STATE", "GRAD_MODE", "SHAPE_ENV") for _, kind in dropped)
    assert any(name.endswith("SETTINGS.value.overlap.enabled") for name, _ in kept), kept
    assert any("_spec.sizes" in name for name, _ in kept) and any(name.endswith("_spec.dim") for name, _ in kept)
    assert frames == 2  # the toggled setting recompiled once; toggling back reused the first graph
    assert max(abs(r - eager) for r in results) < 1e-12


def test_wrapper_tensors_recompile_when_a_setting_changes_and_the_guard_filter_keeps_their_guards(ranks):
    """Wrapper domain tensors (issue 64's switch): Dynamo records the model's ops without tracing mesh3d's code, so
    the rules read the settings where nothing guards them; the wrapper's flattened context carries them, so toggling
    ``window_overlap`` recompiles once and toggling back reuses the first graph, as on the storage subclass. The
    filter drops no guard on the input, its layout, tensors or the global state; results equal eager."""
    (decided, frames, results, eager), = ranks.run(1, _guard_filter_body, True, timeout=300)
    dropped = [(name, kind) for name, kind, _, keep in decided if not keep]
    kept = [(name, kind) for name, kind, _, keep in decided if keep]
    assert not any(kind in ("TENSOR_MATCH", "GLOBAL_STATE", "GRAD_MODE", "SHAPE_ENV", "TENSOR_SUBCLASS_METADATA_MATCH")
                   for _, kind in dropped), dropped
    assert any(kind == "TENSOR_SUBCLASS_METADATA_MATCH" for _, kind in kept), kept
    assert frames == 2  # the toggled setting recompiled once; toggling back reused the first graph
    assert max(abs(r - eager) for r in results) < 1e-12


def test_unet_on_blocks_compiles_whole_and_trains_as_one_process(ranks):
    """A 2x2 domain grid (uneven blocks): box halos, pooling and interpolation on blocks, all in one graph."""
    _check(ranks.run(4, _train_compiled_body, "unet", ((8, 6), (6, 4)), "aot_eager", True, (2, 2), timeout=300))


@pytest.mark.parametrize("mode", ["ring", "gather", "ulysses"])
def test_attention_on_a_token_grid_compiles_whole(ranks, mode):
    """A 2x2 grid of uneven blocks flattened into tokens: SDPA over every token of the grid is one custom op in the
    graph in each mode (fullgraph: no break), no recompiles, and the model trains as one process."""
    _check(ranks.run(4, _train_compiled_body, "tokens", ((8, 6), (6, 4)), "aot_eager", True, (2, 2), True, mode,
                     timeout=300))


def test_vit_with_sharded_attention_compiles_whole(ranks):
    """D=2: attention over the sharded sequence is one custom op in the graph (fullgraph: no break), and the ViT
    trains as one process, with no recompiles."""
    _check(ranks.run(2, _train_compiled_body, "vit", (8, 6), "aot_eager", True, timeout=300))


def _compiled_sdpa_body(cases: list[dict]) -> list[tuple[float, int]]:
    """Each case: SDPA on shards inside one compiled graph (fullgraph), in a given mode, against one process."""
    DistributedManager.initialize(batch=1, domain=-1)
    results = []
    for case in cases:
        gen = torch.Generator().manual_seed(case["seed"])
        kind, sizes = case["kind"], case["sizes"]
        n, kv_heads = sum(sizes), 2 if kind == "gqa" else 4
        q, k, v = (torch.randn(2, h, n, 3, dtype=torch.float64, generator=gen).requires_grad_(True)
                   for h in (4, kv_heads, kv_heads))
        causal = kind in ("causal", "gqa")
        mask = None
        if kind == "bool":
            mask = torch.rand(1, 4, n, n, generator=gen) > 0.4
        elif kind in ("float", "local_bias"):
            mask = torch.randn(2, 1, n, n, dtype=torch.float64, generator=gen).requires_grad_(True)

        def sdpa(a, b, c, m, causal=causal, gqa=kind == "gqa"):
            return F.scaled_dot_product_attention(a, b, c, attn_mask=m, is_causal=causal, enable_gqa=gqa)

        ref = sdpa(q, k, v, mask)
        cot = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
        (ref * cot).sum().backward()
        leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
        want = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        qs, ks, vs = (domain.shard(t, dim=2, sizes=sizes) for t in (q, k, v))
        ms = domain.shard(mask, dim=2, sizes=sizes) if kind == "local_bias" else mask
        counter = CompileCounterWithBackend(case["backend"])  # Inductor checks the custom op's strides too
        step = torch.compile(sdpa, backend=counter, fullgraph=True, dynamic=False)
        with domain.attention_mode(case["mode"]):
            out = step(qs, ks, vs, ms)
            whole = out.full_tensor()
            (whole * cot).sum().backward()
        errors = [max_err(whole.to_local(), ref)] + [max_err(domain_sum(t.grad), w) for t, w in zip(leaves, want)]
        results.append((max(errors), counter.frame_count))
    return results


#: SDPA cases compiled on shards: every mode, masks plain, sharded like the queries and with a gradient, GQA.
_SDPA_CASES = [{"kind": kind, "mode": mode, "seed": i, "backend": "inductor" if i in (1, 2) else "aot_eager"}
               for i, (kind, mode) in enumerate(
    [("plain", "ring"), ("causal", "ring"), ("float", "ring"), ("bool", "gather"), ("local_bias", "gather"),
     ("gqa", "ring"), ("plain", "ulysses"), ("causal", "auto")])]


@pytest.mark.parametrize(("world", "sizes"), [(2, (5, 4)), (3, (4, 0, 5))], ids=["D2", "D3-empty-shard"])
def test_sharded_attention_is_one_custom_op_in_the_graph(ranks, world, sizes):
    """At D>1, SDPA over a sharded sequence compiles into the graph (``mesh3d::sharded_sdpa``, fullgraph: no break)
    in every mode, and equals one process: output and the gradients of q, k, v and a float mask (fp64)."""
    cases = [{**c, "sizes": sizes} for c in _SDPA_CASES if world == 2 or c["mode"] != "ulysses"]
    for results in ranks.run(world, _compiled_sdpa_body, cases, timeout=300):
        for case, (err, frames) in zip(cases, results):
            assert err < 1e-9, (case, err)
            assert frames == 1, (case, frames)


def _nested_dispatch_body(grid: tuple[int, int] | None):
    DistributedManager.initialize(batch=1, domain=grid or -1)
    found: set[str] = set()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, H, W, generator=g, dtype=torch.float64)
    where = {"dims": (2, 3)} if grid else {"dim": 2}
    models = [_model("unet"), _model("vit")] + ([GridViT(tokens=(H // 2) * (W // 2)).double()] if grid else [])
    for model in models:  # GridViT's neighbourhood attention runs on a grid of blocks
        xs = domain.shard(x, **where)
        with NestedDispatchCheck() as check:
            out = model(xs)
            outs = out if isinstance(out, tuple) else (out,)
            loss = sum(F.mse_loss(o, torch.zeros_like(o)) for o in outs)
            loss.backward()
        found.update(check.found)
    return sorted(found)


@pytest.mark.parametrize(("world", "grid"), [(2, None), (4, (2, 2))], ids=["slabs", "blocks"])
def test_rules_send_their_own_torch_calls_through_the_dispatcher(ranks, world, grid):
    """A rule's own ``x.shape`` or ``a - b`` on domain tensors is global in eager code only (Dynamo turns subclass
    dispatch off inside ``__torch_function__``): the models above make none, on slabs, blocks and token grids."""
    for found in ranks.run(world, _nested_dispatch_body, grid, timeout=120):
        assert found == []


# NOTE: Inductor on 4 ranks (2x1x2) covers the ViT's compiled view of a view; the 8-rank uneven 2x2x2 case runs the same
# graphs through aot_eager (Inductor's C++ builds on 8 ranks took a minute of the suite on 2 cores)
@pytest.mark.parametrize(("shape", "sizes", "kind", "backend"), [
    ((2, 1, 2), None, "unet", "aot_eager"), ((2, 1, 2), None, "vit", "inductor"),
    ((2, 2, 2), {"unet": (9, 5), "vit": (8, 6)}, "unet", "aot_eager"),
    ((2, 2, 2), {"unet": (9, 5), "vit": (8, 6)}, "vit", "aot_eager")], ids=["2x1x2-unet", "2x1x2-vit-inductor",
                                                                          "2x2x2-unet", "2x2x2-vit"])
def test_parallelize_compiles_blocks_with_fsdp_tp_and_domain(ranks, shape, sizes, kind, backend):
    """``Plan(compile=...)``: TP, then compile of each block, then FSDP; the domain axis in the model. Trains as one
    process (so as the same plan uncompiled, which test_domain_parallelize checks the same way). The ViT runs with
    Inductor: its tensor-parallel head after global pooling scales gradients by 1/D inside a compiled block, which
    Inductor returns as a view of a view (``compile_blocks._viewed_node``)."""
    world = shape[0] * shape[1] * shape[2]
    layout = sizes[kind] if sizes else None
    for loss_err, grad_err, param_err, graphs in ranks.run(world, _compiled_compose_body, shape, kind, layout,
                                                           None, backend, timeout=300):
        assert loss_err < 1e-9 and grad_err < 1e-9 and param_err < 1e-9
        assert graphs > 0  # the blocks were compiled, not run eagerly


def _compiled_compose_body(shape, kind, sizes, checkpoint=None, backend="aot_eager"):
    counters.clear()
    errs = compose_body(shape, kind, sizes, 3, None, {"backend": backend}, checkpoint)
    return (*errs, counters["stats"]["unique_graphs"])


def _to_local_body(backend: str, sizes: tuple[int, ...]):
    DistributedManager.initialize(batch=1, domain=-1)
    x = torch.randn(2, sum(sizes), 4, dtype=torch.float64, requires_grad=True)
    xs = domain.shard(x, dim=1, sizes=sizes)
    local = torch.compile(lambda t: t.to_local(), backend=backend, fullgraph=True)(xs)
    (local * 2).sum().backward()
    offset = sum(sizes[:xs.spec.comm.index])
    return type(local) is torch.Tensor, torch.equal(local, x[:, offset:offset + local.shape[1]]), float(x.grad.sum())


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_compiled_function_returning_the_shard_answers_with_the_shard(ranks, backend):
    """A graph whose only use of a domain tensor is ``to_local()`` returns an alias of its input. Inductor used to
    raise rebuilding it ("incorrect out shape after application of ViewMeta sequence": the global shape against the
    shard's) at D > 1; the shard comes back plain, equal to the slice, with its gradient, uneven sizes."""
    sizes = (5, 3)
    for rank, (plain, equal, grad_sum) in enumerate(ranks.run(2, _to_local_body, backend, sizes, timeout=300)):
        assert plain and equal
        assert grad_sum == 2.0 * 2 * sizes[rank] * 4


def test_parallelize_compiles_checkpointed_blocks_with_fsdp_tp_and_domain(ranks):
    """torchtitan's whole order from one plan: TP, activation checkpointing (the U-Net's encoder and middle, which
    the body checks carry it), compile, FSDP; the domain axis in the model, uneven (9, 5). Trains as one process."""
    for loss_err, grad_err, param_err, graphs in ranks.run(8, _compiled_compose_body, (2, 2, 2), "unet", (9, 5),
                                                           ["enc", "mid"], timeout=300):
        assert loss_err < 1e-9 and grad_err < 1e-9 and param_err < 1e-9
        assert graphs > 0


def _zoo_compiled_body(name: str, sizes: tuple[int, ...]):
    from zoo.models import ZOO, to_fp64  # NOTE: here, not at the top: it imports every zoo library, on this rank only

    DistributedManager.initialize(batch=1, domain=-1)
    entry = ZOO[name]
    torch.manual_seed(0)
    ref = to_fp64(entry.build())
    model = copy.deepcopy(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)]
    counter = CompileCounterWithBackend("aot_eager")
    loss_of = torch.compile(lambda xs: (entry.forward(model, xs) ** 2).mean(), backend=counter)
    x = entry.make_input()
    errs, first = [], None
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        loss_ref = (entry.forward(ref, x) ** 2).mean()
        loss_ref.backward()
        loss = loss_of(domain.shard(x, dim=entry.dim, sizes=sizes))
        loss.backward()
        errs.append(abs(float(loss.detach().to_local()) - float(loss_ref)) / abs(float(loss_ref)))
        sum_grads_over_domain(model.parameters())
        scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        errs.extend(max_err(q.grad, p.grad) / scale for p, q in zip(ref.parameters(), model.parameters()))
        for opt in opts:
            opt.step()
        first = counter.frame_count if step == 0 else first
    buffers = max((max_err(b, c) for b, c in zip(ref.buffers(), model.buffers())), default=0.0)
    return max(errs), buffers, first, counter.frame_count


def test_zoo_model_compiles_and_trains_as_one_process(ranks):
    """MONAI's UNet (strided residual convs, BatchNorm in training mode, skips), unchanged, compiled at D=3 with an
    uneven split: losses, gradients (relative to the largest) and BatchNorm's running statistics as one process."""
    for err, buffers, first, last in ranks.run(3, _zoo_compiled_body, "monai.UNet", (8, 4, 4), timeout=300):
        assert err < 1e-9 and buffers < 1e-9
        assert last == first


def _compiled_stack_body(cases: list[dict]) -> list[float]:
    """Each case: a conv (its kernel, stride, padding drawn), GroupNorm, GELU and a pooling, compiled (aot_eager,
    fullgraph) on the case's layout of its height, forward and backward, against one process."""
    DistributedManager.initialize(batch=1, domain=-1)
    errs = []
    for case in cases:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Conv2d(2, 4, case["kernel"], case["stride"], case["padding"]),
                                  torch.nn.GroupNorm(2, 4), torch.nn.GELU(), torch.nn.AvgPool2d(2)).double()
        model = copy.deepcopy(ref)
        # NOTE: the width, as the height, leaves at least 3 columns out of the conv and 1 out of the pool (5 left
        # one column at kernel 4, stride 2: the one-process reference failed under hypothesis seed 969752957)
        width = max(5, case["kernel"] + 2 * case["stride"])
        x = torch.randn(2, 2, case["length"], width, dtype=torch.float64)
        loss_ref = (ref(x) ** 2).mean()
        loss_ref.backward()
        # NOTE: static shapes, as docs/domain.md says: each case is a new shape of the same code
        step = torch.compile(lambda xs, m=model: (m(xs) ** 2).mean(), backend="aot_eager", fullgraph=True, dynamic=False)
        loss = step(domain.shard(x, dim=2, sizes=case["sizes"]))
        loss.backward()
        errs.append(max([abs(float(loss.detach().to_local()) - float(loss_ref))]
                        + [max_err(g, p.grad) for p, g in zip(ref.parameters(),
                                                               domain_sums([q.grad for q in model.parameters()]))]))
    return errs


@settings(max_examples=examples(2), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_compiled_windows_on_drawn_layouts_equal_one_process(ranks, data):
    """Hypothesis draws the height, the conv's kernel, stride and padding and every rank's share (empty and
    one-row shards included; the first cases are the edge layouts); each case compiles its own graph."""
    world = data.draw(st.sampled_from([2, 3]))
    cases = []
    for _ in range(2):
        kernel, stride = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 2))
        length = data.draw(st.integers(kernel + 2 * stride, 14))  # at least 3 rows out of the conv, 1 out of the pool
        cases.append({"kernel": kernel, "stride": stride, "padding": data.draw(st.integers(0, kernel // 2)),
                      "length": length, "sizes": data.draw(shard_sizes(length, world))})
    for errs in ranks.run(world, _compiled_stack_body, with_edge_layouts(cases, world), timeout=120):
        assert max(errs) < 1e-9, (cases, errs)
