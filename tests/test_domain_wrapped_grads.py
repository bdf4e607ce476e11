"""Gradients of intermediate wrapper domain tensors, against one process in fp64 (2 and 3 uneven ranks, an empty
shard): rules read an op's fresh result through the shard it was made from, not through the result's own autograd
edge, so everything that asks for an intermediate's whole gradient is asked where every reader's gradient meets.
A hook registered after the tensor was read (and one returning a new gradient), ``retain_grad`` and ``.grad``,
``torch.autograd.grad`` and ``backward(inputs=...)`` with an intermediate among the inputs each see the gradient of
every reader, and the parameters' gradients follow the hook's change."""

from __future__ import annotations

import copy

import pytest
import torch

from domain_cases import domain_sum, max_err

D64 = torch.float64


def _run(conv, x):
    """Reads of ``h`` before and after its hook; what each gradient question answers (gathered for comparison)."""
    h = conv(x)  # a rule's fresh result
    before = (torch.tanh(h) * h.detach()).sum()  # read before the hook is registered (element-wise: h's own edge)
    seen = []
    h.register_hook(lambda g: (seen.append(g.norm().item()), g * 3)[1])
    h.retain_grad()
    u = torch.sin(conv(h))  # a rule reading h (through the shard it was made from)
    loss = before + (u ** 2).sum()
    (dh,) = torch.autograd.grad(loss, h, retain_graph=True)
    loss.backward(retain_graph=True)
    hg = h.grad.clone()
    conv.weight.grad = None
    torch.autograd.backward(loss, inputs=[h])
    return [dh, hg, h.grad], seen


def _intermediate_body(sizes):
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.wrapped import shortcut_alias, wrapper_tensors

    DistributedManager.initialize(batch=1, domain=len(sizes))
    torch.manual_seed(3)
    ref = torch.nn.Conv2d(2, 2, 3, padding=1, dtype=D64)
    mod = copy.deepcopy(ref)
    x = torch.randn(2, 2, sum(sizes), 5, dtype=D64)
    want, seen_ref = _run(ref, x)
    with wrapper_tensors():
        xs = domain.shard(x, dim=2, sizes=sizes)
        read_through_alias = shortcut_alias(mod(xs)) is not None
        got, seen = _run(mod, xs)
    errors = [max_err(g.full_tensor().to_local(), w) for g, w in zip(got, want)]
    errors.append(max(abs(a - b) for a, b in zip(seen, seen_ref)))
    errors.append(max_err(domain_sum(mod.bias.grad), ref.bias.grad))
    return max(errors), len(seen), len(seen_ref), read_through_alias


@pytest.mark.parametrize("sizes", [(4, 3), (3, 0, 4)], ids=["2-uneven", "3-empty-middle"])
def test_intermediate_gradients_are_whole_when_readers_bypass_the_tensors_own_edge(ranks, sizes):
    for err, calls, calls_ref, through_alias in ranks.run(len(sizes), _intermediate_body, sizes):
        assert through_alias, "the fast read this test is about is not taken"
        assert err < 1e-12 and calls == calls_ref, (err, calls, calls_ref)
