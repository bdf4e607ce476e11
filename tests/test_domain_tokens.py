"""Token grids: blocks flattened into tokens (a ViT on a 2x2, 2x3 or 2x2x2 domain grid), against one process (fp64).

The ViT (``domain_models.GridViT``) is plain torch code: class token, position embedding, global SDPA,
neighbourhood attention on the grid, tokens back to the grid for a conv decoder, a head on the class token.
Equal to one process (outputs, loss, input and parameter gradients, parameters after SGD steps) on uneven
and empty blocks; masks over the global token order; refusals on every rank."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from domain_cases import domain_sum, edge_layouts, max_err, shard_sizes, sum_grads_over_domain
from domain_models import GridViT
from mesh3d.domain.ops.grid_reshape import place_run
from profiles import examples

TOL = 1e-10


def _vit_body(grid, cases, steps):
    """Each case: (global spatial shape, block sizes per dim or None). SGD steps of GridViT vs one process."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=grid)
    nd = len(grid)
    worst, layouts = 0.0, []
    for i, (shape, sizes) in enumerate(cases):
        torch.manual_seed(i)
        ref = GridViT(math.prod(n // 2 for n in shape), nd=nd).double()
        mod = copy.deepcopy(ref)
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * i + step)
            x = torch.randn(2, 2, *shape, dtype=torch.float64, generator=gen, requires_grad=True)
            label = torch.randn(2, 3, dtype=torch.float64, generator=gen)
            y_ref, c_ref = ref(x)
            target = torch.randn(y_ref.shape, dtype=torch.float64, generator=gen)
            loss_ref = F.mse_loss(y_ref, target) + F.mse_loss(c_ref, label)
            loss_ref.backward()

            xi = x.detach().requires_grad_(True)
            ys, cs = mod(domain.shard(xi, dims=tuple(range(2, 2 + nd)), sizes=sizes))
            loss = F.mse_loss(ys, domain.shard(target, dims=ys.spec.dims, sizes=ys.spec.sizes)) + F.mse_loss(cs, label)
            loss.backward()
            layouts.append(ys.spec.sizes)
            worst = max(worst, abs(float(loss) - float(loss_ref)), max_err(ys.full_tensor().to_local(), y_ref),
                        max_err(cs.to_local(), c_ref), max_err(domain_sum(xi.grad), x.grad))
            sum_grads_over_domain(mod.parameters())
            for p, q in zip(ref.parameters(), mod.parameters()):
                worst = max(worst, max_err(q.grad, p.grad))
            opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
        worst = max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))
    return worst, layouts


@settings(max_examples=examples(2), deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no slow shrinking
@given(data=st.data())
def test_vit_on_a_2d_token_grid_trains_like_one_process(ranks, data):
    for grid in ((2, 2), (2, 3)):
        shape = (data.draw(st.integers(8, 13)), data.draw(st.integers(8, 13)))
        cases = [(shape, tuple(data.draw(shard_sizes(n, g)) for n, g in zip(shape, grid))),
                 # every call: blocks of one row, and empty blocks (the last column, or both outer columns at 3)
                 ((10, 12), (edge_layouts(10, grid[0])[0], edge_layouts(12, grid[1])[-1]))]
        results = ranks.run(math.prod(grid), _vit_body, grid, cases, 2, timeout=120)
        assert max(r[0] for r in results) < TOL, results
        assert any(0 in s for s in results[0][1][-1]), "the empty-block case must leave blocks of the grid empty"


def test_vit_on_a_3d_token_grid_on_2x2x2_trains_like_one_process(ranks):
    cases = [((8, 6, 7), ((5, 3), (2, 4), (4, 3))), ((6, 6, 6), None)]
    results = ranks.run(8, _vit_body, (2, 2, 2), cases, 2, timeout=180)
    assert max(r[0] for r in results) < TOL, results


def _mask_body(sizes):
    """SDPA with is_causal and with a float attn_mask over the global token order, full_tensor and layouts."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(30, 30, dtype=torch.float64, generator=gen, requires_grad=True)
    errors = {}
    for name, kwargs in (("causal", {"is_causal": True}), ("bias", {"attn_mask": bias})):
        t_ref = x.flatten(2).transpose(1, 2).unsqueeze(1)
        out_ref = F.scaled_dot_product_attention(t_ref, t_ref * 2, t_ref, **kwargs)
        (out_ref * out_ref).sum().backward()
        gx_ref = x.grad.clone()
        gb_ref = bias.grad.clone() if bias.grad is not None else None
        x.grad, bias.grad = None, None
        xs = domain.shard(x, dims=(2, 3), sizes=sizes)
        t = xs.flatten(2).transpose(1, 2).view(1, 1, -1, 4)
        out = F.scaled_dot_product_attention(t, t * 2, t, **kwargs)
        (out * out).sum().backward()
        errors[name] = max(max_err(out.full_tensor().to_local(), out_ref), max_err(domain_sum(x.grad), gx_ref))
        if gb_ref is not None:
            errors[name] = max(errors[name], max_err(domain_sum(bias.grad), gb_ref))
        x.grad, bias.grad = None, None
    # attention written by hand: scores against every key, a (N, N) bias in the global order, softmax, values
    t_ref = x.flatten(2).transpose(1, 2)
    scores_ref = (t_ref @ t_ref.transpose(1, 2)) + bias
    out_ref = torch.softmax(scores_ref, -1) @ t_ref
    (out_ref * out_ref).sum().backward()
    gx_ref, gb_ref = x.grad.clone(), bias.grad.clone()
    x.grad, bias.grad = None, None
    t = domain.shard(x, dims=(2, 3), sizes=sizes).flatten(2).transpose(1, 2)
    scores = (t @ t.transpose(1, 2)) + bias
    out = torch.softmax(scores, -1) @ t
    (out * out).sum().backward()
    errors["matmul"] = max(max_err(scores.full_tensor().to_local(), scores_ref), max_err(out.full_tensor().to_local(),
                           out_ref), max_err(domain_sum(x.grad), gx_ref), max_err(domain_sum(bias.grad), gb_ref))
    return errors


def test_attention_masks_use_the_global_token_order(ranks):
    for sizes in (((4, 2), (2, 3)), ((4, 2), (0, 5))):  # blocks not contiguous in the global order; empty blocks
        for errors in ranks.run(4, _mask_body, sizes):
            assert max(errors.values()) < TOL, (sizes, errors)


def _layout_body():
    """Reshapes that keep or rebuild the layout, and refusals raised on every rank."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2))
    x = torch.arange(2 * 3 * 6 * 4, dtype=torch.float64).reshape(2, 3, 6, 4)
    xs = domain.shard(x, dims=(2, 3), sizes=((4, 2), (1, 3)))
    t = xs.flatten(2)
    checks = {
        "tokens in global order": bool(torch.equal(t.full_tensor().to_local(), x.flatten(2))),
        "global shape": tuple(t.global_shape) == (2, 3, 24),
        "the shape is global": tuple(t.shape) == (2, 3, 24) and t.local_shape[2] == xs.to_local()[0, 0].numel(),
        "channels last": bool(torch.equal(xs.permute(0, 2, 3, 1).full_tensor().to_local(), x.permute(0, 2, 3, 1))),
        "split heads keeps tokens": bool(torch.equal(
            t.transpose(1, 2).reshape(2, -1, 3, 1).full_tensor().to_local(), x.flatten(2).transpose(1, 2)[..., None])),
        "back to blocks": bool(torch.equal(t.reshape(2, 3, *xs.shape[2:]).full_tensor().to_local(), x)),
    }
    # Segformer's idiom, with a row and a column of empty blocks: (B, N, C) -> (B, h, w, -1) -> channels first
    xe = domain.shard(x, dims=(2, 3), sizes=((6, 0), (4, 0)))
    back = xe.flatten(2).transpose(1, 2).reshape(2, *xe.shape[2:], -1).permute(0, 3, 1, 2)
    checks["empty blocks find the same dims"] = bool(torch.equal(back.full_tensor().to_local(), x))
    pos = torch.arange(24, dtype=torch.float64).view(1, 24, 1)
    checks["softmax over the tokens"] = bool(torch.allclose(t.softmax(2).full_tensor().to_local(),
                                                            x.flatten(2).softmax(2), rtol=1e-12, atol=1e-15))
    checks["position rows follow the tokens"] = bool(torch.equal(
        (t.transpose(1, 2) + pos).full_tensor().to_local(), x.flatten(2).transpose(1, 2) + pos))
    # a reshape that splits the block dims runs on slabs (the blocks moved to slabs along the first block dim)
    checks["flatten(1) of blocks, through slabs"] = bool(torch.equal(xs.flatten(1).full_tensor().to_local(), x.flatten(1)))
    refusals = []
    for attempt in (lambda: t.reshape(2, 72), lambda: t.transpose(1, 2) + torch.ones(1, 5, 1),
                    lambda: torch.roll(t, 1, 2), lambda: t.cumsum(2), lambda: t[:, :, 3],
                    lambda: domain.redistribute(t, dim=2)):
        try:
            attempt()
            refusals.append("no error")
        except (NotImplementedError, ValueError) as err:
            refusals.append(str(err))
    return checks, refusals


def test_token_layouts_and_refusals_on_every_rank(ranks):
    results = ranks.run(4, _layout_body)
    for checks, refusals in results:
        assert all(checks.values()), checks
        assert "would mix tokens with other dims" in refusals[0]
        assert "meets a token grid of 24 tokens" in refusals[1] and "give it 24 rows" in refusals[1]
        assert "torch.roll has no rule for token grids" in refusals[2]
        assert "cumsum has no rule for token grids" in refusals[3]
        assert "only prefix tokens" in refusals[4]
        assert "reshape the tokens back to the grid first" in refusals[5]


def test_a_reshape_places_the_sharded_run_the_same_on_empty_and_full_blocks():
    """Every rank must find the same target dim; an empty block cannot infer a -1 from its element count."""
    assert place_run([2, 3, -1], [2, 3, 4, 5], 2, 3, [20]) == (2, [2, 3, 20])           # flatten(2) of blocks
    assert place_run([2, 3, -1], [2, 3, 0, 5], 2, 3, [0]) == (2, [2, 3, 0])             # ... of an empty block
    assert place_run([1, 4, 5, -1], [1, 20, 8], 1, 1, [4, 5]) == (1, [1, 4, 5, 8])      # reshape(b, h, w, -1)
    assert place_run([1, 0, 5, -1], [1, 0, 8], 1, 1, [0, 5]) == (1, [1, 0, 5, 8])       # ... on an empty block
    assert place_run([2, -1, 3, 4], [2, 0, 12], 1, 1, [0]) == (1, [2, 0, 3, 4])         # split heads, no tokens
    assert place_run([2, 1, 6, 4], [2, 6, 4], 1, 1, [6]) == (2, [2, 1, 6, 4])           # a new unit dim before
    assert place_run([2, 72], [2, 3, 24], 2, 2, [24]) is None                            # tokens mixed with channels


def test_neighbourhood_attention_on_plain_tensors_is_the_windowed_softmax():
    """The one-process reference itself: each query's output is softmax attention over its window only."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 12, 3, dtype=torch.float64, generator=gen) for _ in range(3))
    from mesh3d.domain import neighbourhood_attention

    out = neighbourhood_attention(q, k, v, radius=(1, 2), grid=(3, 4))
    i, j = 1, 1  # token 5: rows 0..2, columns 0..3 (radius 2 reaches every column)
    window = [r * 4 + c for r in range(0, 3) for c in range(0, 4)]
    weights = torch.softmax(q[0, 0, 5] @ k[0, 0, window].T / math.sqrt(3), -1)
    assert torch.allclose(out[0, 0, i * 4 + j], weights @ v[0, 0, window])
    corner = [r * 4 + c for r in range(0, 2) for c in range(0, 3)]  # token 0: rows 0..1, columns 0..2
    weights = torch.softmax(q[0, 0, 0] @ k[0, 0, corner].T / math.sqrt(3), -1)
    assert torch.allclose(out[0, 0, 0], weights @ v[0, 0, corner])
    with pytest.raises(ValueError, match="one per grid dim"):
        neighbourhood_attention(q, k, v, radius=(1, 2, 3), grid=(3, 4))

