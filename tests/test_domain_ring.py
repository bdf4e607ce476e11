"""Attention over domain-sharded sequences and token grids (ring, gather, ulysses) against one process, fp64.

Each case builds q, k, v (and a mask) as global leaves, shards them (slabs with uneven and empty shards, or a
token grid from blocks), runs attention in a mode, and compares with the same call in one process: the
output, the gradients of q, k, v and of a float mask (summed over the domain), relative error <= 1e-10.
Cases: plain, causal (zigzag-balanced ring), bool mask, float bias (plain, and on slabs sharded like the
queries), sliding windows, GQA, an explicit scale; both ring kernels; head groups. The ring's in-flight
K/V bytes and messages are asserted, the zigzag's work balance is computed in process, and refusals raise
on every rank. The model-level test (a decoder with FSDP and TP) is in tests/test_domain_ring_model.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from domain_cases import domain_sum, shard_sizes
from profiles import examples

TOL = 1e-10
KINDS = ("plain", "causal", "bool", "float", "window", "band", "gqa", "scale", "local_bias")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def _kwargs(kind: str, n: int, heads: int, gen: torch.Generator) -> tuple[dict, torch.Tensor | None]:
    """The attention arguments of a case, and the float mask whose gradient is compared (None: none)."""
    if kind == "causal" or kind == "gqa":
        return {"is_causal": True}, None
    if kind == "bool":
        mask = torch.rand(1, heads, n, n, generator=gen) > 0.4
        mask[..., min(2, n - 1), :] = False  # a row that sees nothing (output and gradient 0, as one process)
        return {"attn_mask": mask}, None
    if kind in ("float", "local_bias"):
        bias = torch.randn(2, 1, n, n, dtype=torch.float64, generator=gen).requires_grad_(True)
        return {"attn_mask": bias}, bias
    if kind == "window":
        return {"is_causal": True, "window": (3, 0)}, None
    if kind == "band":
        return {"window": (2, 4)}, None
    if kind == "scale":
        return {"scale": 0.37}, None
    return {}, None


def _window_mask(n: int, window: tuple[int, int], causal: bool | None) -> torch.Tensor:
    """Which keys each query sees, built here from the definition: query i sees keys i - left .. i + right (and none
    after itself when causal), by global position."""
    left, right = window
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = (j >= i - left) & (j <= i + right)
    return seen & (j <= i) if causal else seen


def test_the_window_mask_of_the_reference_is_the_definition():
    assert _window_mask(5, (1, 2), False).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1],
                                                             [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert _window_mask(4, (2, 0), True).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]


def _run_case(case: dict):
    """One case on every rank: (worst relative error, ring stats) against one process."""
    from mesh3d import domain
    from mesh3d.domain.attention.ring import RING_STATS

    kind, layout, mode = case["kind"], case["layout"], case["mode"]
    gen = torch.Generator().manual_seed(case["seed"])
    heads, kv_heads, e = 4, (2 if kind == "gqa" else 4), 3
    grid = case["shape"] if layout == "tokens" else None
    n = math.prod(grid) if grid else case["shape"]

    def leaf(h):
        if grid:
            return torch.randn(2, h * e, *grid, dtype=torch.float64, generator=gen).requires_grad_(True)
        return torch.randn(2, h, n, e, dtype=torch.float64, generator=gen).requires_grad_(True)

    xq, xk, xv = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    kwargs, bias = _kwargs(kind, n, heads, gen)
    gqa = {"enable_gqa": True} if kind == "gqa" else {}

    def heads_of(x, h, sharded):
        if not grid:
            return domain.shard(x, dim=2, sizes=case["sizes"]) if sharded else x
        t = domain.shard(x, dims=(2, 3), sizes=case["sizes"]) if sharded else x
        t = t.flatten(2).transpose(1, 2)
        return t.view(t.shape[0], -1, h, e).transpose(1, 2)

    # The reference is torch's own SDPA, with the window's mask written out here (not mesh3d's mask rule).
    ref_kwargs = kwargs if "window" not in kwargs else {"attn_mask": _window_mask(n, kwargs["window"], kwargs.get("is_causal"))}
    ref = F.scaled_dot_product_attention(heads_of(xq, heads, False), heads_of(xk, kv_heads, False),
                                         heads_of(xv, kv_heads, False), **ref_kwargs, **gqa)
    cot = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    (ref * cot).sum().backward()
    want = [t.grad.clone() for t in (xq, xk, xv)] + ([bias.grad.clone()] if bias is not None else [])
    for t in (xq, xk, xv, bias):
        if t is not None:
            t.grad = None
    qs, ks, vs = heads_of(xq, heads, True), heads_of(xk, kv_heads, True), heads_of(xv, kv_heads, True)
    if kind == "local_bias":  # a bias sharded like the queries (its rows): O(S^2 / D) per rank
        kwargs["attn_mask"] = domain.shard(bias, dim=2, sizes=qs.spec.sizes)
    RING_STATS.reset()
    with domain.attention_mode(mode, kernel=case["kernel"], head_groups=case["groups"]):
        out = domain.attention(qs, ks, vs, **kwargs, **gqa)
    stats = (RING_STATS.max_in_flight_bytes, RING_STATS.messages)
    whole = out.full_tensor()
    (whole * cot).sum().backward()
    errors = [_rel(whole.to_local(), ref)]
    errors += [_rel(domain_sum(t.grad), w) for t, w in zip((xq, xk, xv, bias), want) if t is not None]
    return max(errors), stats


def _cases_body(grid, cases):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=grid)
    return [_run_case(c) for c in cases]


def _cases(data, world: int, layout: str, modes=("ring",)) -> list[dict]:
    out = []
    for i, kind in enumerate(KINDS):
        if layout == "tokens" and kind == "local_bias":
            continue
        mode = modes[i % len(modes)] if not (kind == "local_bias" and "ulysses" in modes) else "ring"
        if layout == "tokens":
            shape = (data.draw(st.integers(3, 6)), data.draw(st.integers(3, 6)))
            sizes = tuple(data.draw(shard_sizes(s, 2)) for s in shape)
        else:
            shape = data.draw(st.integers(world + 3 * (i % 3), 24))  # some shorter than 2D (empty zigzag chunks)
            sizes = data.draw(shard_sizes(shape, world))
        out.append({"kind": kind, "layout": layout, "mode": mode, "shape": shape, "sizes": sizes, "seed": i,
                    "kernel": "math" if i % 3 == 2 else "fused", "groups": 1 + i % 3})
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@settings(max_examples=examples(2), deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_ring_on_slabs_equals_one_process(ranks, world, data):
    """Every kind of attention on uneven slabs (empty ones drawn too) in the ring; gather and ulysses on 4 ranks."""
    cases = _cases(data, world, "slab")
    if world == 4:
        cases += _cases(data, world, "slab", modes=("gather", "ulysses"))
    results = ranks.run(world, _cases_body, (world,), cases, timeout=150)
    for c, (err, _) in zip(cases, results[0]):
        assert err < TOL, (c, err)
    for rank_results in results[1:]:
        assert [r[0] < TOL for r in rank_results] == [True] * len(cases)


@settings(max_examples=examples(2), deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_ring_on_a_token_grid_equals_one_process(ranks, data):
    """A 2x2 grid of blocks flattened into tokens (block order, uneven and empty blocks): ring, gather, ulysses."""
    cases = _cases(data, 4, "tokens", modes=("ring", "gather", "ring", "ulysses"))
    cases.append({**cases[1], "shape": (4, 6), "sizes": ((4, 0), (3, 3)), "seed": 99})  # a row of empty blocks
    results = ranks.run(4, _cases_body, (2, 2), cases, timeout=150)
    for rank_results in results:
        for c, (err, _) in zip(cases, rank_results):
            assert err < TOL, (c, err)


def _traffic_body(sizes, groups):
    """Bytes and messages of one ring forward and backward, and the most K/V bytes held in transit at once."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.attention.ring import RING_STATS

    DistributedManager.initialize(batch=1, domain=len(sizes))
    q, k, v = (domain.shard(torch.randn(2, 4, sum(sizes), 3, dtype=torch.float64, requires_grad=True), dim=2,
                            sizes=sizes) for _ in range(3))
    RING_STATS.reset()
    with domain.attention_mode("ring", head_groups=groups), domain.count_traffic() as fwd:
        out = domain.attention(q, k, v)
    forward = (fwd.bytes_sent, fwd.messages, RING_STATS.max_in_flight_bytes)
    loss = out.full_tensor().sum()
    with domain.count_traffic() as bwd:
        loss.backward()
    return forward, bwd.bytes_sent, RING_STATS.max_grad_in_flight_bytes


def test_ring_sends_each_block_once_around_and_holds_two_blocks(ranks):
    """At D=4, rank r sends the blocks of ranks r, r-1, r-2 on (one message per head group each), never holds more
    than two blocks of a head group, and its backward sends them again plus their gradients home (D hops)."""
    sizes, groups = (5, 0, 7, 3), 2
    per_row = 2 * 2 * 3 * 8  # batch x (key + value) x head size x 8 bytes, per head
    for r, (forward, backward, grad_in_flight) in enumerate(ranks.run(4, _traffic_body, sizes, groups)):
        blocks = [sizes[(r - t) % 4] for t in range(3)]
        assert forward[0] == sum(blocks) * per_row * 4  # all 4 heads, in 2 groups
        assert forward[1] == groups * sum(1 for b in blocks if b)
        held = max(sizes[(r - t) % 4] + sizes[(r - t - 1) % 4] for t in range(3))
        assert forward[2] <= held * per_row * 2  # two blocks of one group (2 heads)
        home = sum(sizes[(r - t) % 4] for t in range(4))
        assert backward == forward[0] + home * per_row * 4  # K/V again, plus every block's dK/dV one hop per step
        assert grad_in_flight <= 2 * max(sizes) * per_row * 2


def _refusals_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=2)
    x = torch.randn(2, 4, 10, 3, dtype=torch.float64)
    q = domain.shard(x, dim=2)
    three = domain.shard(torch.randn(2, 3, 10, 3, dtype=torch.float64), dim=2)
    two = domain.shard(torch.randn(2, 2, 10, 3, dtype=torch.float64), dim=2)
    mask = torch.ones(10, 10, dtype=torch.bool)
    attempts = {
        "dropout": lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
        "mask_and_causal": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True),
        "ulysses_heads": lambda: domain.attention(three, three, three, mode="ulysses"),
        "mask_shape": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(10, 7, dtype=torch.bool)),
        "mask_dtype": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(10, 10)),
        "window": lambda: domain.attention(q, q, q, window=(-1, 0)),
        "causal_window": lambda: domain.attention(q, q, q, is_causal=True, window=(2, 3)),
        # a plain key with a plain value is cross-attention (ops/mixed_attention.py); with a sharded value it is refused
        "plain_key": lambda: F.scaled_dot_product_attention(q, x, q),
        "gqa_heads": lambda: F.scaled_dot_product_attention(three, two, two, enable_gqa=True),
        "heads_without_gqa": lambda: F.scaled_dot_product_attention(q, two, two),
        "mode": lambda: domain.attention(q, q, q, mode="flash"),
        "kernel": lambda: domain.attention_mode("ring", kernel="cudnn").__enter__(),
        "sharded_mask_ulysses": lambda: domain.attention(q, q, q, attn_mask=domain.shard(torch.ones(1, 1, 10, 10,
                                                         dtype=torch.bool), dim=2), mode="ulysses"),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except (NotImplementedError, ValueError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


def test_refusals_raise_clearly_on_every_rank(ranks):
    results = ranks.run(2, _refusals_body, timeout=60)
    assert results[0] == results[1]
    m = results[0]
    assert not [k for k, v in m.items() if v is None], m
    assert "NotImplementedError" in m["dropout"] and "dropout_p=0" in m["dropout"]
    assert "not both" in m["mask_and_causal"]
    assert "divide by 2" in m["ulysses_heads"] and "'ring'" in m["ulysses_heads"]
    assert "(..., 10, 10)" in m["mask_shape"] and "torch.float32" in m["mask_dtype"]
    assert "non-negative" in m["window"] and "is_causal=True" in m["causal_window"]
    assert "key and value must be laid out alike" in m["plain_key"] and "key whole, value sequence" in m["plain_key"]
    assert "multiple" in m["gqa_heads"] and "enable_gqa" in m["heads_without_gqa"]
    assert "'flash' is not one of" in m["mode"] and "'cudnn'" in m["kernel"]
    assert "ulysses" in m["sharded_mask_ulysses"] and "'ring' or 'gather'" in m["sharded_mask_ulysses"]
