"""Shared helpers for the domain tests: rank-side utilities and hypothesis strategies for shard sizes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from hypothesis import example
from hypothesis import strategies as st


@st.composite
def shard_sizes(draw, length: int, parts: int):
    """None (the torch.chunk rule) or explicit sizes, uneven, with shards of length 1 and 0 allowed."""
    if draw(st.booleans()):
        return None
    cuts = sorted(draw(st.lists(st.integers(0, length), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, length]
    return tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def edge_layouts(length: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """The uneven layouts every run covers, whatever hypothesis draws: a one-row shard first and empty shards
    inside, the rows all on the last rank, and empty first and last ranks (one rank holding everything at 3).

    ``edge_layouts(9, 2) == ((1, 8), (0, 9), (9, 0))``; ``edge_layouts(9, 4) == ((1, 0, 0, 8), (0, 5, 4, 0))``
    """
    if parts == 1:
        return ((length,),)
    if length < 2:
        return tuple(dict.fromkeys([(length,) + (0,) * (parts - 1), (0,) * (parts - 1) + (length,)]))
    if parts == 2:
        return ((1, length - 1), (0, length), (length, 0))
    inner = parts - 2
    middle = tuple(length // inner + (i < length % inner) for i in range(inner))
    return ((1,) + (0,) * inner + (length - 1,), (0, *middle, 0))


def with_edge_layouts(cases: list[dict], parts: int) -> list[dict]:
    """``cases`` (dicts with ``length`` and ``sizes``), the first ones laid out as the edge layouts of their own
    lengths: every rank-pool call covers them, with the rest of each case (kernel, stride ...) as drawn."""
    out = [dict(c) for c in cases]
    for i, case in enumerate(out[:len(edge_layouts(2, parts))]):
        layouts = edge_layouts(case["length"], parts)
        case["sizes"] = layouts[i % len(layouts)]
    return out


@st.composite
def layout_case(draw, length: int, worlds: tuple[int, ...]):
    """``(world, (sizes,))``: a world size and one layout of ``length`` rows drawn for it (see ``edge_examples``)."""
    world = draw(st.sampled_from(worlds))
    return world, (draw(shard_sizes(length, world)),)


def on_each_layout(body, layouts) -> list:
    """``[body(sizes) for sizes in layouts]`` on the ranks: a test's layouts in one rank-pool call.

    Usage: ``ranks.run(world, on_each_layout, _ops_body, layouts)``
    """
    return [body(sizes) for sizes in layouts]


def edge_examples(length: int, worlds: tuple[int, ...]):
    """Explicit hypothesis examples for a test taking ``case=(world, layouts)``: for each world size, all of its
    edge layouts in one case (one rank-pool call). Hypothesis runs them first, on every run and in every profile.

    Usage: ``@given(case=layout_case(9, (2, 4)))`` then ``@edge_examples(9, (2, 4))`` above ``def test(ranks, case)``
    """
    def decorate(test):
        for world in reversed(worlds):
            test = example(case=(world, edge_layouts(length, world)))(test)
        return test
    return decorate


def domain_sum(t: torch.Tensor | None) -> torch.Tensor | None:
    """Sum a tensor over the domain group (how parameter and input gradients are combined)."""
    return domain_sums([t])[0]


def domain_sums(ts: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``domain_sum`` of each tensor, in two collectives (presence, then all of them at once per dtype).

    Usage: ``grads = domain_sums([q.grad for q in model.parameters()])``

    NOTE: a model's gradients were summed one parameter at a time, three collectives each: in the zoo's test they took
    8.8 of its 31.6 s on a rank, most of it waiting for peers.
    """
    from mesh3d import DistributedManager

    dm = DistributedManager()
    if dm.axis_size("domain") == 1:
        return [None if t is None else t.detach().clone() for t in ts]
    group, world = dm.group("domain"), dm.axis_size("domain")
    # A grad missing on some ranks only would desynchronize FSDP's reductions: say so.
    present = torch.tensor([t is not None for t in ts], dtype=torch.int64)
    dist.all_reduce(present, group=group)
    assert all(c in (0, world) for c in present.tolist()), "a gradient is None on some domain ranks only (an empty " \
        "shard's rule left a parameter unconnected)"
    out: list[torch.Tensor | None] = [None] * len(ts)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):  # the same order on every rank: presence is, and so are the dtypes
        if t is not None and type(t) is not torch.Tensor:  # a subclass is summed as it is, alone
            out[i] = t.detach().clone()
            dist.all_reduce(out[i], group=group)
        elif t is not None:
            by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([ts[i].detach().reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        for i, part in zip(idx, flat.split([ts[i].numel() for i in idx])):
            out[i] = part.view(ts[i].shape).clone()
    return out


def sum_grads_over_domain(params: Iterable[torch.Tensor]) -> None:
    """Each parameter's gradient becomes its sum over the domain (``domain_sums``: two collectives for them all).

    Usage: ``loss.backward(); sum_grads_over_domain(model.parameters()); opt.step()``
    """
    params = list(params)
    for p, g in zip(params, domain_sums([p.grad for p in params])):
        if g is not None:
            p.grad = g


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return 0.0 if a.numel() == 0 else float((a.detach() - b.detach()).abs().max())


def refusals(calls: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Each call's ``NotImplementedError`` message, or ``"ran"`` where it raised none (what tests of refusals read)."""
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = "ran"
        except NotImplementedError as err:
            found[name] = str(err)
    return found


def grads_err(model_ref: torch.nn.Module, model: torch.nn.Module) -> float:
    """Largest difference of one-process grads vs domain-summed grads of the same parameters (a parameter the model did
    not use has no grad on either side: 0; on one side only: inf)."""
    errs = [float("inf") if (p.grad is None) != (g is None) else 0.0 if g is None else max_err(p.grad, g)
            for p, g in zip(model_ref.parameters(), domain_sums([q.grad for q in model.parameters()]))]
    return max(errs, default=0.0)


def compare_to_one_process(make, x: torch.Tensor, dim: int, sizes, seed: int = 0) -> float:
    """Largest error of ``make()`` on ``x`` sharded along ``dim`` vs one process: output, input grad, param grads, buffers.

    ``make`` returns a module or a function; a copy of the module runs on the shards. A replicated
    result is backpropagated directly (the gradient convention), a sharded one through ``full_tensor``.
    """
    import copy

    from mesh3d import domain

    torch.manual_seed(seed)
    x = x.detach().requires_grad_(x.is_floating_point())
    ref = make()
    mod = copy.deepcopy(ref)
    y = ref(x)
    cot = torch.randn_like(y) if not y.is_complex() else torch.randn(y.shape, dtype=y.dtype)
    gx = None
    if x.requires_grad:
        (y * cot).real.sum().backward()
        gx, x.grad = x.grad, None
    else:
        (y * cot).real.sum().backward()
    ys = mod(domain.shard(x, dim=dim, sizes=sizes))
    if isinstance(ys, domain.DomainTensor) and ys.sharded_dim is not None:
        ys = ys.full_tensor()
    out = ys.to_local() if isinstance(ys, domain.DomainTensor) else ys  # replicated, or plain (whole on every rank)
    (ys * cot).real.sum().backward()
    err = max_err(out, y)
    if gx is not None:
        err = max(err, max_err(domain_sum(x.grad), gx))
    if isinstance(ref, torch.nn.Module):
        err = max(err, grads_err(ref, mod))
        for b_ref, b in zip(ref.buffers(), mod.buffers()):
            err = max(err, max_err(b_ref.double(), b.double()))
    return err


def step_both(ref: torch.nn.Module, mod: torch.nn.Module, opt_ref, opt, loss_ref, loss) -> float:
    """One optimizer step of the one-process model and of its domain copy (gradients summed over the domain), after
    ``loss_ref`` and ``loss`` were backpropagated; the largest difference of the losses and then of the parameters."""
    worst = abs(float(loss) - float(loss_ref))
    sum_grads_over_domain(mod.parameters())
    opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
    return max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))


def trained_alike(ref: torch.nn.Module, loss: Callable[[torch.nn.Module, int, bool], torch.Tensor], steps: int,
                  lr: float, twin: torch.nn.Module | None = None) -> float:
    """``ref`` and a copy of it trained ``steps`` SGD steps side by side: ``loss(model, step, sharded)`` is the step's
    loss of ``ref`` in one process (``sharded`` False) and of the copy on domain tensors (True); the largest
    difference of the losses and parameters over the steps (``step_both``).

    ``twin``: the copy, built alike, for a module ``copy.deepcopy`` cannot copy (torch-harmonics' attention holds a
    ``torch.ops`` namespace).

    Usage: ``trained_alike(net, lambda m, step, sharded: m(shard(x(step)) if sharded else x(step)).mean(), 3, 0.1)``
    """
    mod = copy.deepcopy(ref) if twin is None else twin
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=lr), torch.optim.SGD(mod.parameters(), lr=lr)
    worst = 0.0
    for step in range(steps):
        loss_ref = loss(ref, step, False)
        loss_ref.backward()
        loss_mod = loss(mod, step, True)
        loss_mod.backward()
        worst = max(worst, step_both(ref, mod, opt_ref, opt, loss_ref, loss_mod))
    return worst


def case_error(run, x0: torch.Tensor, seed: int) -> float | str:
    """``run(x, sharded)`` in one process and on the domain: the largest error of its value and of ``x``'s gradient
    (a random cotangent drawn from ``seed``), or the first words of a refusal (``NotImplementedError``) on the domain.

    Usage: ``case_error(lambda x, sharded: torch.diff(domain.shard(x, dim=2) if sharded else x, dim=2), x0, 0)``
    """
    from mesh3d import domain

    x = x0.clone().requires_grad_()
    want = run(x, False)
    cot = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(seed))
    (want * cot).sum().backward()
    want_grad, x.grad = x.grad, None
    try:
        got = run(x, True)
    except NotImplementedError as refusal:
        return str(refusal).split(":")[0]
    if got.spec.layout is domain.Layout.REPLICATED:  # a replicated result: backward on it directly
        whole = got.to_local()
        (got * cot).sum().backward()
    else:
        whole = got.full_tensor().to_local()
        (whole * cot).sum().backward()
    return max(max_err(whole, want.detach()), max_err(domain_sum(x.grad), want_grad))


def on_blocks(fn, sizes, dims: tuple[int, ...] = (2, 3)):
    """``fn`` as ``case_error``'s ``run``: on ``x`` in one process, on its blocks over ``dims`` (``sizes``) sharded.

    Usage: ``case_error(on_blocks(lambda x: x.flip(2), ((5, 3), (2, 6))), x0, 0)``
    """
    from mesh3d import domain

    return lambda x, sharded: fn(domain.shard(x, dims=dims, sizes=sizes) if sharded else x)


def assert_equal_or_refused(errors: dict, refusals: dict, tol: float) -> None:
    """Every case of ``errors`` (``case_error``'s answers) within ``tol``, but those of ``refusals`` (name -> the
    refusal's first words), which must be refused so and only those."""
    refused = {k: v for k, v in errors.items() if isinstance(v, str)}
    assert refused.keys() == refusals.keys() and all(refused[k].startswith(v) for k, v in refusals.items()), refused
    bad = {k: v for k, v in errors.items() if k not in refused and not v < tol}
    assert not bad, bad


#: Slabs of 2 and 3 uneven ranks (an empty shard among them) and 2x2 uneven blocks of a (..., 9, 6) field: the layouts
#: of the per-family rule tests (``ranks.run(spec["world"], body, spec)``; ``"dims"`` marks blocks).
RULE_LAYOUTS = {
    "slabs 2 (6, 3)": {"world": 2, "grid": 2, "sizes": (6, 3)},
    "slabs 3 (4, 0, 5)": {"world": 3, "grid": 3, "sizes": (4, 0, 5)},
    "blocks 2x2 (5, 4) x (2, 4)": {"world": 4, "grid": (2, 2), "dims": True, "sizes": ((5, 4), (2, 4))},
}
