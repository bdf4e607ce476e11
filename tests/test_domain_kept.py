"""Calls on wrapper tensors answered from a kept answer (``mesh3d.domain.dispatch.kept``): the dispatcher's walk runs for
the first call of a signature only, and what later calls get is what the dispatcher (and one process) gives.

Checked against references the path did not build: the one-process value of every ruled slab call, called twice on
1 and 3 uneven ranks (an empty shard among them), the second answer kept (the first call on other values: an answer
that kept the first call's tensors would give their values); the dispatcher's own answer with the path off, for
element-wise ops, views and convolutions (values, spec, gradients, views recorded, journal entries, each call on other
values) in one process; a small U-Net trained 3 Adam steps on 1 and 3 ranks against one process and bitwise against the path off;
which calls never skip the walk.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mesh3d import domain
from mesh3d._torch_private import TorchDispatchMode, disable_torch_function_subclass
from mesh3d.domain.comm.divergence import JOURNAL
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import unwrap, wrap
from mesh3d.domain.core.wrapped import WrappedDomainTensor, wrapper_tensors
from mesh3d.domain.dispatch.elementwise_plan import plan_elementwise
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.kept import KEPT
from mesh3d.domain.dispatch.registry import RULES

D64 = torch.float64
THREE = DomainComm(None, (0, 1, 2), 1)  # this rank holds the middle shard: element-wise ops and views move nothing
SPEC = DomainSpec(2, (3, 2, 4), THREE)  # (B, C, H, W) sharded along H; this rank's 2 rows
ONE = DomainSpec(2, (2,), DomainComm(None, (0,), 0))


@pytest.fixture(autouse=True)
def _wrapper_tensors():
    with wrapper_tensors():
        yield


def _local(seed: int, requires_grad: bool = False) -> torch.Tensor:
    local = torch.randn(2, 3, 2, 5, dtype=D64, generator=torch.Generator().manual_seed(seed))
    return local.requires_grad_(requires_grad)


OPS = {
    "x + 1": lambda x, y: x + 1.0,
    "x * y": lambda x, y: x * y,
    "torch.add(x, y, alpha=2)": lambda x, y: torch.add(x, y, alpha=2),
    "relu": lambda x, y: torch.relu(x),
    "F.gelu tanh": lambda x, y: F.gelu(x, approximate="tanh"),
    "x.pow(2) - y": lambda x, y: x.pow(2) - y,
    "clamp(min=)": lambda x, y: x.clamp(min=-0.5),
    "lerp": lambda x, y: torch.lerp(x, y, 0.3),
    "addcmul": lambda x, y: torch.addcmul(x, x, y, value=0.5),
    "masked_fill by a domain mask": lambda x, y: x.masked_fill(y > 0, 0.0),
    "x > y (bool)": lambda x, y: (x > y),
    "to(float32)": lambda x, y: x.to(torch.float32) * 2,
    "clone, then add_": lambda x, y: x.clone().add_(y),
    "contiguous (itself)": lambda x, y: x.contiguous() * 1.0,
    "zeros_like": lambda x, y: torch.zeros_like(x) + y,
    "detach": lambda x, y: x.detach() * y,
    "+= on a fresh result": lambda x, y: _iadd(x * 1.0, y),
    "mul_ on a transposed view": lambda x, y: _mul_view(x * 1.0, y),
    "relu_ on a channel slice": lambda x, y: _relu_slice(x * y),
    "softmax over channels": lambda x, y: torch.softmax(x, 1) * y,
    "a 1x1 convolution": lambda x, y: F.conv2d(x, torch.ones(4, 3, 1, 1, dtype=D64)),
}


def _iadd(z, y):
    z += y
    return z


def _mul_view(z, y):
    z.transpose(2, 3).mul_(y.transpose(2, 3))  # an in-place op on a view writes through to its base
    return z


def _relu_slice(z):
    z[:, 1:].relu_()
    return z


def _run(fn, spec, seeds=(0, 1)):
    """(the result's shard, spec, the input gradients, journal entries made) of ``fn`` on fresh wrapper tensors."""
    lx, ly = _local(seeds[0], requires_grad=True), _local(seeds[1], requires_grad=True)
    before = JOURNAL.count
    out = fn(wrap(lx, spec), wrap(ly, spec))
    assert type(out) is WrappedDomainTensor
    entries = [e[1:3] for e in list(JOURNAL.entries)[before - JOURNAL.count:]] if JOURNAL.count > before else []
    grads = None
    if out.requires_grad:
        grads = torch.autograd.grad(unwrap(out).double().sum(), [lx, ly], allow_unused=True)
    return unwrap(out).detach().clone(), out.spec, grads, entries


def _equal(got, want) -> bool:
    (a, sa, ga, ja), (b, sb, gb, jb) = got, want
    if not torch.equal(a, b) or sa != sb or ja != jb:
        return False
    return ga is None and gb is None or all((p is None and q is None) or torch.equal(p, q) for p, q in zip(ga, gb))


@pytest.mark.parametrize("spec", [SPEC, ONE], ids=["middle of 3", "one rank"])
@pytest.mark.parametrize("name", OPS)
def test_an_op_from_its_kept_answer_is_the_dispatcher_s(name, spec):
    """Values, spec, input gradients and journal entries of each op: the first call, two kept ones, and the dispatcher's
    own answer with the path off."""
    hits = KEPT.hits
    for seeds in ((0, 1), (2, 3), (4, 5)):  # NOTE: other values each call: a kept answer holding the last call's
        with KEPT.off():  # tensors would give the last call's values
            want = _run(OPS[name], spec, seeds)
        assert _equal(_run(OPS[name], spec, seeds), want), (name, seeds)
    assert KEPT.hits > hits, "the kept answers were not used"


VIEWS = {
    "view": lambda x: x.view(2, 3, x.shape[2] * 5),
    "reshape(-1)": lambda x: x.reshape(2, -1, x.shape[2], 5).reshape(2, 3, -1),
    "flatten(2)": lambda x: x.flatten(2),
    "flatten(start_dim=1)": lambda x: torch.flatten(x, start_dim=2),
    "transpose": lambda x: x.transpose(1, 2),
    "permute": lambda x: x.permute(0, 2, 3, 1),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "squeeze": lambda x: x.unsqueeze(0).squeeze(0),
    "expand": lambda x: x[:, :1].expand(2, 4, -1, 5),
    "unflatten": lambda x: x.unflatten(3, (5, 1)),
    "slice of the sharded dim": lambda x: x[:, :, 1:],
    "select": lambda x: x[:, 1],
    "narrow then view(-1) refused": lambda x: _raised(lambda: x.transpose(2, 3).view(-1)),
}


def _raised(fn):
    try:
        return fn()
    except RuntimeError as err:
        return str(err)


@pytest.mark.parametrize("spec", [SPEC, ONE], ids=["middle of 3", "one rank"])
@pytest.mark.parametrize("name", VIEWS)
def test_a_view_from_its_kept_answer_is_the_dispatcher_s(name, spec):
    """Each view three times, on other values each time (the later two kept), against the dispatcher's on the same
    values: values, spec, gradients, the one-process strides and offset, whether the result views its input (writes
    into it replay the view), the journal entries; a view one process refuses raises its error every time."""
    for seed in (0, 1, 2):  # NOTE: other values each time (module docstring)
        results = []
        for kept in (True, False):
            with contextlib.nullcontext() if kept else KEPT.off():
                results.append(_view_outcome(VIEWS[name], spec, seed))
        got, want = results
        if isinstance(want, str):
            assert got == want
            continue
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2]), name
        assert got[3:] == want[3:], (name, got[3:], want[3:])


def _view_outcome(view, spec, seed):
    """(values, spec, gradient, journal entries, strides, offset, contiguity, views recorded) of ``view``, or the
    error one process raises."""
    lx = _local(seed, requires_grad=True)
    before = JOURNAL.count
    out = view(wrap(lx, spec))
    if isinstance(out, str):
        return out
    entries = [e[1:3] for e in list(JOURNAL.entries)[before - JOURNAL.count:]] if JOURNAL.count > before else []
    weights = torch.arange(unwrap(out).numel(), dtype=D64).view_as(unwrap(out))
    (grad,) = torch.autograd.grad((unwrap(out) * weights).sum(), lx)
    return (unwrap(out).detach().clone(), out.spec, grad, entries, out.stride(), out.storage_offset(),
            out.is_contiguous(), out._views_domain, out._replay is not None)


class _Counted:
    """The dispatcher, counting the calls that reach it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __call__(self, func, types, args, kwargs):
        self.calls.append(func)
        return self.inner(func, types, args, kwargs)


def test_only_what_a_kept_answer_covers_skips_the_dispatcher(monkeypatch):
    """Element-wise ops of one layout never reach the dispatcher; another ruled call reaches it once per signature;
    ``out=``, an in-place write, a ``torch.ops`` operator, an op without a rule and an op that fails reach it on every
    call; a rule registered over a kept one is the one that runs. One rank: what reaches the dispatcher runs there."""
    import mesh3d.domain.dispatch.kept as kept_module

    counted = _Counted(kept_module.dispatch)
    monkeypatch.setattr(kept_module, "dispatch", counted)
    x, y = wrap(_local(0), ONE), wrap(_local(1), ONE)
    _ = (x * y + 1.0).relu(), x.shape, x.dtype, x.size(2), x.ndim
    assert counted.calls == []
    plain = torch.ones(1, 3, 1, 1, dtype=D64)
    for i, fn in enumerate((lambda: x * plain, lambda: x.sum(), lambda: x.mean(3), lambda: x.transpose(1, 3))):
        seen = []
        for _ in range(3):
            counted.calls.clear()
            fn()
            seen.append(len(counted.calls))
        assert seen[0] >= 1 and seen[1:] == [0, 0], (i, seen)
    buf = wrap(torch.empty_like(_local(0)), ONE)
    wide = wrap(torch.zeros(2, 4, 2, 5, dtype=D64), ONE)  # the same layout, another channel count
    for fn, func in ((lambda: torch.add(x, y, out=buf), torch.add), (lambda: torch.mul(x, wide), torch.mul),
                     (lambda: (x * 1.0).add_(y), torch.Tensor.add_), (lambda: F.relu(x * 1.0, inplace=True), F.relu),
                     (lambda: torch.ops.aten.add.Tensor(x, y), torch.ops.aten.add.Tensor)):
        for _ in range(2):
            counted.calls.clear()
            try:
                fn()
            except RuntimeError as err:  # torch's own error (the channels differ), raised by the dispatcher's run
                assert "must match" in str(err)
            assert func in counted.calls, f"{func} did not reach the dispatcher"
    for _ in range(2):
        counted.calls.clear()
        with pytest.raises(NotImplementedError, match="histc"):  # no rule: refused by name, every time
            x.histc()
        assert torch.Tensor.histc in counted.calls
    with pytest.raises(ValueError, match="histc has no slab rule"):  # nor can a function without one have a plan
        plan_elementwise(torch.Tensor.histc)

    for func, call in ((torch.relu, lambda: torch.relu(x)), (torch.Tensor.sum, lambda: x.sum())):
        original = RULES.get(func)
        seen = []
        domain.register(func, override=True)(lambda *a, **k: seen.append(1) or original(*a, **k))
        try:
            for _ in range(2):
                call()
            assert len(seen) == 2, f"a rule registered over {func}'s was bypassed"
        finally:
            domain.register(func, override=True)(original)
        seen.clear()
        counted.calls.clear()
        call()
        call()
        assert counted.calls.count(func) <= 1, counted.calls


def test_a_convolution_is_kept_with_each_calls_own_weight():
    """A convolution's kept step binds the weight and bias each call passes (its function never closes over them):
    new weights, the 1x1 convolution of the middle shard of 3 and any on one rank, equal to the path off, journaled
    alike."""
    g = torch.Generator().manual_seed(7)
    cases = [(SPEC, 1, {}), (ONE, 3, {"padding": 1}), (ONE, 3, {"padding": "same"}), (ONE, 1, {"stride": (1, 2)})]
    for spec, k, kw in cases:
        for _ in range(3):
            w = torch.randn(4, 3, k, k, dtype=D64, generator=g)
            b = torch.randn(4, dtype=D64, generator=g)
            outs = []
            for kept in (True, False):
                with contextlib.nullcontext() if kept else KEPT.off():
                    outs.append(_run(lambda x, y: F.conv2d(x, w, b, **kw), spec))
            assert _equal(*outs), (spec, kw)
            if spec.comm.size == 1:  # the whole tensor: torch's convolution of it
                assert torch.allclose(outs[0][0], F.conv2d(_local(0), w, b, **kw), rtol=1e-12, atol=1e-13)


ALIASED = {
    "cat": lambda p, q: torch.cat([p, q], 1),
    "stack": lambda p, q: torch.stack([p, q], 0),
    "where": lambda p, q: torch.where(p > 0, p, q),
}


@pytest.mark.parametrize("spec", [SPEC, ONE], ids=["middle of 3", "one rank"])
@pytest.mark.parametrize("name", ALIASED)
def test_a_tensor_passed_twice_keeps_nothing_a_later_call_could_misread(name, spec):
    """``f(x, x)`` first, then ``f(a, b)`` of the same signature: a kept step would have put ``a`` in both places (on
    74012db ``torch.cat([a, b])`` on the middle shard of 3 gave ``cat([a, a])``); against the path off."""
    g = torch.Generator().manual_seed(11)
    x, a, b = (wrap(torch.randn(2, 3, 2, 5, dtype=D64, generator=g), spec) for _ in range(3))
    for p, q in ((x, x), (a, b), (b, a), (a, a), (a, b)):
        got = ALIASED[name](p, q)
        with KEPT.off():
            want = ALIASED[name](p, q)
        assert torch.equal(got.to_local(), want.to_local()) and got.spec == want.spec, name


class _BackwardTypes(TorchDispatchMode):
    """The classes of the tensors each op of a backward receives (the engine hands an op the tensors autograd saved:
    a domain tensor among them would reach ``__torch_function__`` from any mode that calls ops in Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = [*args, *(kwargs or {}).values()]
        self.seen |= {f"{func}:{type(a).__name__}" for a in leaves if isinstance(a, torch.Tensor)}
        with disable_torch_function_subclass():
            return func(*args, **(kwargs or {}))


SAVING = {  # ops whose backward reads their inputs (autograd saves them)
    "x * y": lambda x, y, w: x * y,
    "addcmul": lambda x, y, w: torch.addcmul(x, x, y, value=0.5),
    "x.pow(2)": lambda x, y, w: x.pow(2),
    "conv2d (one rank)": lambda x, y, w: F.conv2d(x, w, padding=1),
    "view, then mul": lambda x, y, w: x.reshape(2, 3, -1) * y.reshape(2, 3, -1),
}


@pytest.mark.parametrize("name", SAVING)
def test_autograd_saves_what_the_dispatcher_saves(name):
    """Kept answers run each op on the shards' aliases, as the dispatcher does: the backward's ops receive the same
    classes of tensors on either path (never a wrapper autograd saved where the dispatcher saves a plain shard)."""
    w = torch.randn(4, 3, 3, 3, dtype=D64, generator=torch.Generator().manual_seed(3))
    seen = []
    for kept in (True, True, False):
        with contextlib.nullcontext() if kept else KEPT.off():
            lx, ly = _local(0, requires_grad=True), _local(1, requires_grad=True)
            out = SAVING[name](wrap(lx, ONE), wrap(ly, ONE), w)
            mode = _BackwardTypes()
            with mode:
                torch.autograd.grad(unwrap(out).sum(), [lx, ly], allow_unused=True)
            seen.append(mode.seen)
    assert seen[0] == seen[1] == seen[2]


def test_gradient_queries_are_the_dispatcher_s():
    """``.grad``, ``torch.autograd.grad`` and ``backward`` (``dispatch.grads``: answered as the whole tensor) are never
    answered first: ``.grad`` of a domain tensor is a domain tensor laid out like it."""
    for func in GRADIENT_CALLS:
        assert func not in WrappedDomainTensor._queries, func
    xs = domain.shard(torch.randn(2, 3, 4, 5, dtype=D64), dim=2).requires_grad_()
    for _ in range(2):
        xs.grad = None
        (xs * xs).sum().backward()
        assert type(xs.grad) is WrappedDomainTensor and xs.grad.shape == xs.shape and xs.grad.spec == xs.spec
        assert torch.equal(xs.grad.full_tensor(), 2 * xs.full_tensor().detach())


# ----------------------------------------------------------------------------- on real ranks
def _same(a, b) -> bool:
    """Equal values (a domain tensor's whole value), and the same kind of result."""
    from mesh3d.domain import DomainTensor

    if isinstance(a, DomainTensor):
        a = a.full_tensor()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.allclose(a, b, rtol=1e-12, atol=1e-13, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    return a == b


def _sweep_body(sizes):
    from layout_cases import calls

    from mesh3d import DistributedManager
    from mesh3d.domain.dispatch.registry import op_name

    DistributedManager.initialize(batch=1, domain=len(sizes))
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(2, 3, sum(sizes), 4, dtype=D64, generator=g)
    y0 = torch.randn(2, 3, sum(sizes), 4, dtype=D64, generator=g).abs() + 0.5
    x1 = torch.randn(2, 3, sum(sizes), 4, dtype=D64, generator=g)
    y1 = torch.randn(2, 3, sum(sizes), 4, dtype=D64, generator=g).abs() + 0.5
    outcome: dict[str, str] = {}
    for func in sorted(RULES, key=op_name):
        for i, call in enumerate(calls(func, x0, y0, 2)):
            label = f"{op_name(func)}#{i}"
            try:
                expected = call(x0.clone(), y0.clone())
            except Exception:  # noqa: BLE001  (not a call this function takes)
                continue
            hits, seen = KEPT.hits, []
            try:
                # NOTE: the second call of a signature is answered from what the first kept; the first is on other
                # values, so an answer that kept the first call's tensors gives the first call's values
                for a, b, want in ((x1, y1, None), (x0, y0, expected)):
                    got = call(domain.shard(a.clone(), dim=2, sizes=sizes), domain.shard(b.clone(), dim=2, sizes=sizes))
                    if want is not None:
                        seen.append(_same(got, want))
                outcome[label] = ("kept " if KEPT.hits > hits else "") + ("equal" if all(seen) else f"WRONG {seen}")
            except Exception as err:  # noqa: BLE001  (refused, alike on every rank: the same on either call)
                outcome[label] = "refused" if isinstance(err, (NotImplementedError, ValueError, RuntimeError,
                                                                 TypeError, IndexError)) and not seen else \
                    f"WRONG {seen}: {type(err).__name__}: {str(err)[:200]}"
            failed = torch.tensor([0 if outcome[label] != "refused" and "WRONG" not in outcome[label] else 1])
            dist.all_reduce(failed)
            if int(failed):  # NOTE: a rank that failed alone leaves notices in flight: start the mesh afresh
                DistributedManager.shutdown()
                DistributedManager.initialize(batch=1, domain=len(sizes))
    return outcome


@pytest.mark.parametrize("sizes", [(7,), (1, 0, 6)], ids=["one rank", "3 uneven ranks, one empty"])
def test_every_ruled_slab_call_kept_equals_one_process(ranks, sizes):
    """Every ruled slab call the layout sweep makes, twice: the second answered from the kept answer equals one
    process (values, and the kind of result) on every rank."""
    per_rank = ranks.run(len(sizes), _sweep_body, sizes, timeout=900)
    labels = set().union(*per_rank)
    wrong = {k: [r.get(k) for r in per_rank] for k in labels if any("WRONG" in (r.get(k) or "WRONG") for r in per_rank)}
    assert wrong == {}, wrong
    kept = sum(all((r.get(k) or "").startswith("kept") for r in per_rank) for k in labels)
    assert kept > 100, (kept, len(labels))


class _UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e = self.a(x)
        m = self.b(F.max_pool2d(e, 2))
        u = F.interpolate(m, scale_factor=2, mode="bilinear", align_corners=False) + self.up(m)
        return self.head(torch.cat([u, e], 1))


def _training_body(sizes):
    from domain_cases import sum_grads_over_domain

    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=len(sizes))
    torch.manual_seed(0)
    ref = _UNet().double()
    models = {"kept": copy.deepcopy(ref), "dispatcher": copy.deepcopy(ref)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-2) for k, m in [("ref", ref), *models.items()]}
    g = torch.Generator().manual_seed(1)
    worst = {k: 0.0 for k in models}
    hits = KEPT.hits
    for _ in range(3):
        x, t = torch.randn(2, 2, 12, 10, dtype=D64, generator=g), torch.randn(2, 1, 12, 10, dtype=D64, generator=g)
        opts["ref"].zero_grad()
        F.mse_loss(ref(x), t).backward()
        opts["ref"].step()
        for name, model in models.items():
            opts[name].zero_grad()
            with KEPT.off() if name == "dispatcher" else contextlib.nullcontext():
                loss = F.mse_loss(model(domain.shard(x, dim=2, sizes=sizes)), domain.shard(t, dim=2, sizes=sizes))
                loss.backward()
            sum_grads_over_domain(model.parameters())  # NOTE: each rank's share of a parameter's gradient, summed
            opts[name].step()
        for name, model in models.items():
            for p, q in zip(ref.parameters(), model.parameters()):
                worst[name] = max(worst[name], (p - q).abs().max().item())
        for p, q in zip(models["kept"].parameters(), models["dispatcher"].parameters()):
            worst["kept against dispatcher"] = max(worst.get("kept against dispatcher", 0.0), (p - q).abs().max().item())
    return worst, KEPT.hits - hits


@pytest.mark.parametrize("sizes", [(12,), (6, 0, 6)], ids=["one rank", "3 ranks, one empty"])
def test_a_unet_trains_equal_to_one_process_with_answers_kept(ranks, sizes):
    for worst, hits in ranks.run(len(sizes), _training_body, sizes, timeout=300):
        # NOTE: Adam divides by the root of tiny second moments: the summation order of a sum over ranks shows at 1e-10
        assert max(worst.values()) < 1e-9 and worst["kept against dispatcher"] == 0.0, worst
        # its convolutions (halos included), norms, pooling, interpolation and concatenation were answered kept
        assert hits > 20, hits


def _edges_body():
    from mesh3d import DistributedManager
    from mesh3d.domain.dispatch.kept import _on_shards
    from mesh3d.domain.dispatch.step import Step

    DistributedManager.initialize(batch=1, domain=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, 4, dtype=D64, generator=g)
    out = {}
    xs = domain.shard(x, dim=2)
    # torch's result of another length along the sharded dim than the rule's (a data-dependent size): refused
    out["size"] = _on_shards(lambda t: t[:, :, :5], (xs,), {}, (xs.spec,))[0] is NotImplemented
    # a rule registered after a call is kept: its answer from then on, and the old one's after it is dropped
    saved = RULES.snapshot()
    for _ in range(2):
        F.softsign(xs)
    domain.register(F.softsign, override=True)(lambda t: Step(lambda v: v * 0.0 + 7.0, (t,), out=t.spec))
    mine = [F.softsign(xs).full_tensor() for _ in range(2)]
    RULES.restore(saved)
    back = [F.softsign(xs).full_tensor() for _ in range(2)]
    out["rule"] = (all(bool((m == 7.0).all()) for m in mine), all(torch.allclose(b, F.softsign(x)) for b in back))
    return out


def test_a_wrong_length_and_new_rules_take_the_dispatcher(ranks):
    (out,) = ranks.run(1, _edges_body, timeout=300)
    assert out == {"size": True, "rule": (True, True)}, out


REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "mean over (2, 3)": lambda x: x.mean((2, 3)),
    "sum along H, kept": lambda x: torch.sum(x, 2, keepdim=True),
    "mean along W (local)": lambda x: x.mean(3),
    "var along H": lambda x: x.var(2),
    "amax over (1, 2)": lambda x: x.amax((1, 2)),
    "mse_loss": lambda x: F.mse_loss(x, torch.ones_like(x)),
}


def _reductions_body(sizes):
    from domain_cases import domain_sum

    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=len(sizes))
    out = {}
    for dtype in (D64, torch.bfloat16):
        for name, fn in REDUCTIONS.items():
            got = {}
            for kept in (True, False):
                runs = []
                for seed in (1, 2, 3):  # NOTE: each call on new values: a step kept with the first's would show
                    g = torch.Generator().manual_seed(seed)
                    x = torch.randn(2, 3, sum(sizes), 4, dtype=D64, generator=g).to(dtype).requires_grad_()
                    before = JOURNAL.count
                    with contextlib.nullcontext() if kept else KEPT.off():
                        xs = domain.shard(x, dim=2, sizes=sizes)
                        hits = KEPT.hits
                        y = fn(xs)
                        hit = KEPT.hits > hits
                        whole = y.full_tensor() if isinstance(y, domain.DomainTensor) else y
                        (whole.double() * torch.arange(1.0, whole.numel() + 1, dtype=D64).view(whole.shape)).sum().backward()
                    ref = fn(x.detach().clone().requires_grad_())
                    (ref.double() * torch.arange(1.0, ref.numel() + 1, dtype=D64).view(ref.shape)).sum().backward()
                    entries = [e[1:3] for e in list(JOURNAL.entries)[before - JOURNAL.count:]] if JOURNAL.count > before else []
                    runs.append((whole.detach(), domain_sum(x.grad), ref.detach(), entries))
                got[kept] = (runs, hit)  # the last call's answer kept
            (kept_runs, hit), (off_runs, _) = got[True], got[False]
            tol = 1e-12 if dtype == D64 else 2e-2
            out[f"{name} {dtype}"] = {
                "kept": hit or name == "mse_loss",  # NOTE: a composite: its element-wise loss and mean run nested
                "bitwise as the path off": all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[3] == b[3]
                                               for a, b in zip(kept_runs, off_runs)),
                "one process": all(w.dtype == r.dtype and w.shape == r.shape and  # NOTE: bf16 rounded back, once
                                   torch.allclose(w.double(), r.double(), rtol=tol, atol=tol) for w, _, r, _ in kept_runs),
            }
    return out


def test_reductions_and_losses_are_kept_on_three_ranks_and_equal_one_process(ranks):
    """Sums and means declare their shard's part partial (``step.Partial``), combined by the executor: kept on 3 ranks
    with an empty shard, each call on new values, bitwise the path off (values, gradients, journal entries) and equal
    to one process in fp64 and bf16; variance and maxima, which combine their own parts, too."""
    for per_rank in ranks.run(3, _reductions_body, (3, 0, 4), timeout=300):
        wrong = {k: v for k, v in per_rank.items() if not all(v.values())}
        assert wrong == {}, wrong
