"""Domain-sharded inputs through ``parallelize(model, Plan(batch="fsdp"))``: the U-Net and the ViT train
3 steps equal to one process on meshes (1,4,1), (2,2,1), (1,2,2), (2,2,2).

On meshes with a model axis the plan also gives model styles (parallelize refuses an empty
``Plan.model`` there): the U-Net's convs and norms are ``"replicate"`` (Replicate DTensors that the
domain op rules take as local tensors, halos and all); the ViT's token MLP is colwise/rowwise on
domain-sharded tokens and its head MLP colwise/rowwise on the replicated pooled value (the
tensor-parallel bridge, mesh3d/domain/compose.py).

This is the composition rule end to end: FSDP2 over the flattened batch×domain mesh reduces each
parameter gradient *averaged* over batch and *summed* over domain, so per-shard partial gradients
become the one-process gradient of the mean loss over the global batch with no user code.
Each batch rank holds 2 samples of its own; each domain rank a slab of them (uneven sizes).

fp64, tolerance 1e-9: Adam divides by sqrt(v) and would turn fp32 summation-order noise in a
near-zero gradient into a visible step (torch_pitfalls.md). Raw gradients are compared before each
step as well (Adam is scale-invariant and would hide a gradient off by a factor of D); the ViT uses
SGD with momentum, which is not.
"""

from __future__ import annotations


import pytest
import torch

from domain_compose import compose_body

MESHES = [((1, 4, 1), (5, 1, 6, 2)), ((2, 2, 1), (10, 4)), ((1, 2, 2), (3, 11)), ((2, 2, 2), None)]
VIT_SIZES = {4: (2, 6, 4, 2), 2: (8, 6)}  # the ViT's patch conv has stride 2: shards of even height


@pytest.mark.parametrize(("shape", "sizes"), MESHES, ids=lambda v: "x".join(map(str, v)) if v else "chunk")
def test_unet_with_fsdp_trains_like_one_process(ranks, shape, sizes):
    world = shape[0] * shape[1] * shape[2]
    for loss_err, grad_err, param_err in ranks.run(world, compose_body, shape, "unet", sizes, timeout=120):
        assert loss_err < 1e-9
        assert grad_err < 1e-9
        assert param_err < 1e-9


BLOCK_MESHES = [((2, (2, 2), 1), ((6, 8), (4, 6))), ((1, (2, 2), 2), ((8, 6), (6, 4)))]


@pytest.mark.parametrize("kind", ["unet", "vit"])
@pytest.mark.parametrize(("shape", "sizes"), BLOCK_MESHES, ids=["2x(2x2)x1-fsdp", "1x(2x2)x2-fsdp-tp"])
def test_blocks_with_fsdp_and_tp_train_like_one_process(ranks, shape, sizes, kind):
    """Blocks on a 2x2 domain grid composed with FSDP on batch (8 ranks) and with TP styles on model: the U-Net,
    and the ViT on the token grid its patch embedding's blocks flatten into."""
    world = shape[0] * 4 * shape[2]
    for loss_err, grad_err, param_err in ranks.run(world, compose_body, shape, kind, sizes, timeout=120):
        assert loss_err < 1e-9
        assert grad_err < 1e-9
        assert param_err < 1e-9


@pytest.mark.parametrize("shape", [m for m, _ in MESHES], ids=lambda v: "x".join(map(str, v)))
def test_vit_with_fsdp_trains_like_one_process(ranks, shape):
    world = shape[0] * shape[1] * shape[2]
    sizes = VIT_SIZES[shape[1]]
    for loss_err, grad_err, param_err in ranks.run(world, compose_body, shape, "vit", sizes, timeout=120):
        assert loss_err < 1e-9
        assert grad_err < 1e-9
        assert param_err < 1e-9


def test_fsdp_mixed_precision_casts_domain_inputs(ranks):
    """Plan(param_dtype=fp32) on an fp64 model: FSDP casts each domain-sharded input (is_floating_point,
    .to) and computes in fp32; fp32 rounding (~1e-7 per op) bounds the distance to the fp64 run."""
    for loss_err, grad_err, param_err in ranks.run(4, compose_body, (1, 2, 2), "vit", VIT_SIZES[2], 3,
                                                   torch.float32, timeout=120):
        assert 0 < loss_err < 1e-5 and grad_err < 1e-5 and param_err < 1e-5


def _refusals_body():
    from torch import nn

    from mesh3d import DistributedManager, Plan, domain, parallelize

    DistributedManager.initialize(1, 2, 2)
    errors = []
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)).double()
    net = parallelize(net, Plan(batch=None, model={"0": "colwise", "1": "sequence", "2": "rowwise"}))
    tokens = domain.shard(torch.randn(2, 6, 4, dtype=torch.float64), dim=1)
    try:
        net(tokens)
    except NotImplementedError as e:
        errors.append(str(e))
    lin = parallelize(nn.Sequential(nn.Linear(6, 8)).double(), Plan(batch=None, model={"0": "colwise"}))
    try:  # sharded along the features the Linear mixes
        lin(domain.shard(torch.randn(2, 6, dtype=torch.float64), dim=1))
    except NotImplementedError as e:
        errors.append(str(e))
    return errors


def test_styles_that_cannot_take_domain_inputs_refuse_by_name(ranks):
    for errors in ranks.run(4, _refusals_body, timeout=60):
        assert len(errors) == 2, errors
        assert "SequenceParallel" in errors[0] and "domain-sharded" in errors[0]
        assert "acts on the last dim" in errors[1]


def _linear_unit_body(layout: str):
    import copy
    import warnings

    from torch import nn

    from mesh3d import DistributedManager, Plan, domain, graphs, parallelize

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))  # default units: each Linear

        def forward(self, x):
            h = self.layers[0](x)
            h += 1  # an in-place op on a Linear unit's output: FSDP2's pre-backward hook on it must survive
            return self.layers[1](h)

    DistributedManager.initialize(batch=1, domain=(2, 2) if layout == "blocks" else 4)
    torch.manual_seed(0)
    ref = Net().double()
    net = parallelize(copy.deepcopy(ref), Plan(batch="fsdp"))
    x = torch.randn(2, 6, 5, 4, dtype=torch.float64) if layout == "blocks" else torch.randn(2, 11, 4, dtype=torch.float64)
    if layout == "blocks":
        xs = domain.shard(x, dims=(1, 2))
    elif layout == "nodes":
        xs = domain.shard_nodes(x, graphs.Partition([3, 0, 1, 3, 2, 0, 3, 1, 2, 3, 3], 4), dim=1)  # uneven parts
    else:
        xs = domain.shard(x, dim=1, sizes=(2, 3, 2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = net(xs).square().mean()
        loss.backward()
    ref(x).square().mean().backward()
    grad_err = max(float((p.grad.full_tensor() - q.grad).abs().max()) for p, q in zip(net.parameters(), ref.parameters()))
    return [str(w.message) for w in caught], grad_err


@pytest.mark.parametrize("layout", ["slabs", "blocks", "nodes"])
def test_a_linear_units_output_on_domain_tensors_is_not_a_view(ranks, layout):
    """F.linear of a 3-D or 4-D input is torch's view of one 2-D product; FSDP2 warns for a unit returning a view (an
    in-place op on it drops the unit's pre-backward hook). The domain rules return the product itself: no warning,
    and an in-place op after a Linear unit keeps the one-process gradients."""
    for messages, grad_err in ranks.run(4, _linear_unit_body, layout, timeout=120):
        assert not [m for m in messages if "view" in m], messages
        assert grad_err < 1e-12


def _tp_head_body(domain_size: int):
    import copy
    import warnings

    from torch import nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from mesh3d import DistributedManager, Plan, domain, parallelize

    class Net(nn.Module):  # the root's output is its tensor-parallel head's: DTensor.to_local(), an autograd view
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down, self.head = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 8)

        def forward(self, x):
            return self.head(x + self.down(torch.tanh(self.up(x))))

    DistributedManager.initialize(batch=1, domain=domain_size, model=4 // domain_size)
    torch.manual_seed(0)
    ref = Net().double()
    plan = Plan(model={"up": ColwiseParallel(), "down": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())},
                units=["up", "down"])  # up's output is a view too (Shard(-1), local), down's an all-reduce's
    net = parallelize(copy.deepcopy(ref), plan)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = net(domain.shard(x, dim=1) if domain_size > 1 else x)
        out += 1  # an in-place op on the root's output
        out.square().mean().backward()
    want = ref(x)
    want += 1
    want.square().mean().backward()
    grad_err = max(float((p.grad.full_tensor() - q.grad).abs().max()) for p, q in zip(net.parameters(), ref.parameters()))
    return [str(w.message) for w in caught], grad_err


@pytest.mark.parametrize("domain_size", [1, 2], ids=["plain", "domain"])
def test_a_tensor_parallel_units_output_is_not_a_view(ranks, domain_size):
    """torch's styles hand a module's output back as ``DTensor.to_local()``, an autograd view of the DTensor's local
    tensor; where that is an FSDP unit's output (the model's head, a colwise or rowwise unit), FSDP2 warns that an
    in-place op on it drops the unit's pre-backward hook (and torch refuses an in-place op on that view). mesh3d's
    units return it as a tensor of its own: no warning, and an in-place op on the root's output gives the one-process
    gradients."""
    for messages, grad_err in ranks.run(4, _tp_head_body, domain_size, timeout=120):
        assert not [m for m in messages if "view" in m], messages
        assert grad_err < 1e-12
