"""Input gradients by the contract, against one process in fp64: a domain leaf's ``.grad`` and ``torch.autograd.grad``
answer as the whole tensor (domain tensors laid out like the inputs), and second derivatives (``create_graph=True``)
through halo exchanges (overlapped too), GroupNorm/BatchNorm, max/avg pooling and attention (gather and ring) equal one
process on 2 and 3 uneven slabs with an empty shard and on a 2x2 grid of uneven blocks; a physics-informed loss
(examples/pinn_heat.py) trains equal to one process on slabs (blocks: tests/test_examples.py)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from domain_cases import domain_sum, domain_sums, max_err

D64 = torch.float64
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pinn_heat.py"


class FieldNet(torch.nn.Module):
    """A conv (halo) -> GroupNorm -> tanh -> max + avg pooling (halos) -> BatchNorm -> attention over every pixel
    (a token run on slabs, a token grid on blocks) -> a 1x1 conv: every kind of rule a second derivative goes through."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1, dtype=D64)
        self.gn = torch.nn.GroupNorm(2, 4, dtype=D64)
        self.bn = torch.nn.BatchNorm2d(4, dtype=D64)
        self.qkv = torch.nn.Linear(4, 12, dtype=D64)
        self.out = torch.nn.Conv2d(4, 1, 1, dtype=D64)

    def forward(self, x):
        h = torch.tanh(self.gn(self.conv(x)))
        h = self.bn(F.max_pool2d(h, 3, 1, 1) + F.avg_pool2d(h, 3, 1, 1))
        b, c, height, width = h.shape
        q, k, v = self.qkv(h.flatten(2).transpose(1, 2)).view(b, -1, 3, 2, 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
        return self.out(a.transpose(1, 2).reshape(b, c, height, width) * h)


def _kind(t):
    """"DomainTensor" for a domain tensor of either kind (the storage subclass, or the wrapper behind issue 64's
    switch), else the type's name."""
    from mesh3d.domain import DomainTensor

    return "DomainTensor" if isinstance(t, DomainTensor) else type(t).__name__


def _residual(model, x):
    """A physics-informed-like loss: the output, its gradient field (create_graph) and a second derivative in it."""
    u = model(x)
    (du,) = torch.autograd.grad((u ** 2).sum(), x, create_graph=True)
    return (du ** 2).mean() + (u * du[:, :1]).mean(), du


def _second_derivatives_body(grid, sizes, modes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    x = torch.randn(2, 2, 7, 6, dtype=D64)
    errors = {}
    for mode in modes:
        torch.manual_seed(1)
        ref = FieldNet()
        mod = copy.deepcopy(ref)
        with sdpa_kernel(SDPBackend.MATH):  # torch's fused CPU attention has no second derivative: math, as here
            xr = x.clone().requires_grad_()
            loss_ref, du_ref = _residual(ref, xr)
            loss_ref.backward()
            with domain.attention_mode(mode):
                xs = (domain.shard(x, dims=(2, 3), sizes=sizes) if len(grid) == 2 else
                      domain.shard(x, dim=2, sizes=sizes)).requires_grad_()
                loss, du = _residual(mod, xs)
                loss.backward()
        kinds = (_kind(du), _kind(xs.grad), tuple(du.shape), tuple(xs.grad.shape))
        assert kinds == ("DomainTensor", "DomainTensor", tuple(x.shape), tuple(x.shape)), kinds
        errors[mode] = max([max_err(loss.to_local(), loss_ref), max_err(du.full_tensor().to_local(), du_ref),
                            max_err(xs.grad.full_tensor().to_local(), xr.grad),
                            abs(float(xs.grad.norm()) - float(xr.grad.norm())),
                            *(max_err(g, p.grad) for p, g in zip(ref.parameters(),
                                                                 domain_sums([q.grad for q in mod.parameters()]))),
                            *(max_err(b, c) for b, c in zip(ref.buffers(), mod.buffers()))])
    return errors


@pytest.mark.parametrize("world, sizes", [(2, (2, 5)), (3, (4, 0, 3))])
def test_second_derivatives_through_halos_norms_pooling_and_attention_equal_one_process_on_slabs(ranks, world, sizes):
    for errors in ranks.run(world, _second_derivatives_body, (world,), sizes, ("gather", "ring"), timeout=240):
        assert all(e < 1e-10 for e in errors.values()), errors


def test_second_derivatives_equal_one_process_on_a_2x2_grid_of_blocks(ranks):
    """Blocks: box halos with corners, the pooled windows, the token grid's attention."""
    for errors in ranks.run(4, _second_derivatives_body, (2, 2), ((5, 2), (1, 5)), ("gather", "ring"), timeout=240):
        assert all(e < 1e-10 for e in errors.values()), errors


def _grad_contract_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=3)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, dtype=D64)
    found = {}
    xs = domain.shard(x, dim=1, sizes=(2, 0, 1)).requires_grad_()
    assert xs.grad is None
    (torch.sin(xs) * xs).sum().backward()
    want = torch.sin(x) + x * torch.cos(x)
    found["grad"] = (_kind(xs.grad), tuple(xs.grad.shape), max_err(xs.grad.full_tensor().to_local(), want),
                     abs(float(xs.grad.norm()) - float(want.norm())))
    # a plain grad_outputs of the output's global shape: each rank takes its rows; a parameter's grad stays partial
    w = torch.randn(7, dtype=D64, requires_grad=True)
    ys = xs * w
    cot = torch.randn(2, 3, 7, dtype=D64)
    gx, gw = torch.autograd.grad(ys, (xs, w), grad_outputs=cot)
    found["autograd.grad"] = (_kind(gx), max_err(gx.full_tensor().to_local(), cot * w),
                              max_err(domain_sum(gw), (cot * x).sum((0, 1))))
    # a replicated leaf: its gradient is whole on every rank
    scale = (xs ** 2).sum().detach().requires_grad_()
    (gs,) = torch.autograd.grad((xs * scale).sum(), scale)
    found["replicated"] = (_kind(gs), gs.spec.dim, abs(float(gs.to_local()) - float(x.sum())))
    for name, call in (("implicit", lambda: torch.autograd.grad(ys, xs, retain_graph=True)),
                       ("batched", lambda: torch.autograd.grad(ys, xs, torch.ones(4, 2, 3, 7), is_grads_batched=True)),
                       ("shape", lambda: torch.autograd.grad(ys, xs, torch.ones(2, 3, 6, dtype=D64)))):
        try:
            call()
            found[name] = "no error"
        except (RuntimeError, ValueError, NotImplementedError) as err:
            found[name] = str(err)
    return found


def test_a_domain_leafs_grad_and_autograd_grad_answer_as_the_whole_tensor(ranks):
    for found in ranks.run(3, _grad_contract_body):
        kind, shape, err, norm_err = found["grad"]
        assert (kind, shape) == ("DomainTensor", (2, 3, 7)) and err < 1e-12 and norm_err < 1e-12, found
        assert found["autograd.grad"][0] == "DomainTensor" and max(found["autograd.grad"][1:]) < 1e-12, found
        assert found["replicated"][:2] == ("DomainTensor", None) and found["replicated"][2] < 1e-12, found
        assert "only for scalar outputs" in found["implicit"] and "42 elements" in found["implicit"], found
        assert "is_grads_batched" in found["batched"], found
        assert "grad_outputs of shape (2, 3, 6)" in found["shape"] and "(2, 3, 7)" in found["shape"], found


def _pinn_body(sizes):
    from mesh3d import DistributedManager

    spec = importlib.util.spec_from_file_location("pinn_heat", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    DistributedManager.initialize(batch=1, domain=-1)
    losses, losses_ref, worst = example.train("slabs", 3, (4, 9), sizes)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, losses_ref)), worst


def test_the_physics_informed_example_trains_equal_to_one_process_on_uneven_slabs(ranks):
    """Every step's loss and the parameters after 3 Adam steps; an empty slab included."""
    for loss_err, param_err in ranks.run(3, _pinn_body, (5, 0, 4), timeout=180):
        assert loss_err < 1e-10 and param_err < 1e-10
