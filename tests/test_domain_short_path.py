"""The dispatcher's short path (``mesh3d.domain.dispatch.short_path``): calls answered before the dispatcher's walk give
exactly what the walk gives, and only the calls it can answer take it. One process; specs of a 3-rank domain where
the shards' rows matter (element-wise ops move nothing, so no group is needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mesh3d import domain
from mesh3d._torch_private import TorchDispatchMode, disable_torch_function_subclass
from mesh3d.domain.comm.divergence import JOURNAL
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, unwrap, wrap
from mesh3d.domain.core.wrapped import WrappedDomainTensor, wrapper_tensors
from mesh3d.domain.dispatch.grads import GRADIENT_CALLS
from mesh3d.domain.dispatch.registry import RULES
from mesh3d.domain.dispatch.short_path import take_short_path

THREE = DomainComm(None, (0, 1, 2), 1)  # this rank holds the middle shard
SPEC = DomainSpec(2, (3, 2, 4), THREE)  # (B, C, H, W) sharded along H; this rank's 2 rows


@pytest.fixture(autouse=True)
def _storage_tensors():
    """The storage subclass's short path, even where MESH3D_DOMAIN_WRAPPER=1 is set (a test asking for wrapper tensors
    says so itself)."""
    with wrapper_tensors(False):
        yield


def _local(seed: int, requires_grad: bool = False) -> torch.Tensor:
    local = torch.randn(2, 3, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return local.requires_grad_(requires_grad)


def _field(seed: int) -> DomainTensor:
    return wrap(_local(seed), SPEC)


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


def _full_path(monkeypatch) -> None:
    monkeypatch.setattr(DomainTensor, "_short", {})
    monkeypatch.setattr(WrappedDomainTensor, "_short", {})


@pytest.mark.parametrize("kind", ["storage", "wrapper"])
@pytest.mark.parametrize("name", OPS)
def test_the_short_path_gives_what_the_dispatcher_gives(name, kind, monkeypatch):
    """Values, class, spec and input gradients of each element-wise op, short path against the dispatcher's walk, for
    both kinds of domain tensor (a wrapper's element-wise ops run below autograd: ``core.alike_ops``)."""
    results = []
    cls = WrappedDomainTensor if kind == "wrapper" else DomainTensor
    for short in (True, False):
        if not short:
            _full_path(monkeypatch)
        lx, ly = _local(0, requires_grad=True), _local(1, requires_grad=True)
        with wrapper_tensors(kind == "wrapper"):
            out = OPS[name](wrap(lx, SPEC), wrap(ly, SPEC))
        assert type(out) is cls and out.spec == SPEC, (name, short)
        local = unwrap(out).detach().clone()
        grads = None
        if out.requires_grad:
            grads = torch.autograd.grad(unwrap(out).double().sum(), [lx, ly], allow_unused=True)
        results.append((local, grads))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    if ga is not None:
        for p, q in zip(ga, gb):
            assert (p is None and q is None) or torch.equal(p, q)


class _Counted:
    """The dispatcher, counting the calls that reach it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __call__(self, func, types, args, kwargs):
        self.calls.append(func)
        return self.inner(func, types, args, kwargs)


def test_only_what_the_short_path_can_answer_takes_it(monkeypatch):
    """Same-layout element-wise ops and metadata/size queries never reach the dispatcher; a plain operand, another
    layout, a replicated value, a reduction, ``out=``, a ``torch.ops`` operator, an op without a rule, an op that
    fails (its error raised by the dispatcher, which tells the peers) or a rule registered over the element-wise one
    do. One rank: what reaches the dispatcher runs there."""
    one = DomainSpec(2, (2,), DomainComm(None, (0,), 0))
    counted = _Counted(DomainTensor._dispatcher)
    monkeypatch.setattr(DomainTensor, "_dispatcher", staticmethod(counted))
    x, y = wrap(_local(0), one), wrap(_local(1), one)
    _ = (x * y + 1.0).relu(), x.shape, x.dtype, x.size(2), x.ndim
    assert counted.calls == []
    plain = torch.ones(1, 3, 1, 1, dtype=torch.float64)
    other = wrap(_local(2).transpose(2, 3).contiguous(), DomainSpec(3, (2,), one.comm))  # sharded along another dim
    replicated = (x.sum() * 1.0)
    for fn in (lambda: x * plain, lambda: x.sum(), lambda: replicated + 1.0, lambda: x.mean(3)):
        counted.calls.clear()
        fn()
        assert counted.calls, "a call the short path cannot answer did not reach the dispatcher"
    buf = wrap(torch.empty_like(_local(0)), one)
    wide = wrap(torch.zeros(2, 4, 2, 5, dtype=torch.float64), one)  # the same layout, another channel count
    for fn, func in ((lambda: torch.add(x, y, out=buf), torch.add), (lambda: torch.mul(x, wide), torch.mul)):
        counted.calls.clear()
        try:
            fn()
        except RuntimeError as err:  # torch's own error (the channels differ), raised by the dispatcher's run
            assert "must match" in str(err)
        assert func in counted.calls, "out= or a failing op did not reach the dispatcher"
    counted.calls.clear()
    torch.ops.aten.add.Tensor(x, y)  # an operator of torch.ops: the dispatcher rules it or refuses it, never this path
    assert torch.ops.aten.add.Tensor in counted.calls
    counted.calls.clear()
    with pytest.raises(NotImplementedError, match="histc"):  # no rule: refused by name, on the short path or not
        x.histc()
    assert torch.Tensor.histc in counted.calls
    with pytest.raises(ValueError, match="histc has no slab rule"):  # nor can a function without one take the path
        take_short_path(torch.Tensor.histc, lambda func, args, kwargs: NotImplemented)
    counted.calls.clear()
    with pytest.raises(ValueError, match="sharded along different dims"):
        _ = x + other
    assert counted.calls

    original = RULES.get(torch.relu)
    seen = []
    domain.register(torch.relu, override=True)(lambda t: seen.append(t) or original(t))
    try:
        counted.calls.clear()
        torch.relu(x)
        assert seen and torch.relu in counted.calls, "a rule registered over the element-wise one was bypassed"
    finally:
        domain.register(torch.relu, override=True)(original)
    counted.calls.clear()
    torch.relu(x)
    assert counted.calls == []


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
}


@pytest.mark.parametrize("kind", ["storage", "wrapper"])
@pytest.mark.parametrize("name", VIEWS)
def test_a_view_from_its_kept_step_is_the_dispatcher_s(name, kind, monkeypatch):
    """Each view twice (the second from the kept step) against the dispatcher's walk: values, spec, gradients, and for
    wrapper tensors whether the result views its input (writes into it replay the view); on the 3-rank domain a view
    that changes the layout is journaled alike."""
    results = []
    cls = WrappedDomainTensor if kind == "wrapper" else DomainTensor
    for short in (True, True, False):
        if not short:
            _full_path(monkeypatch)
        lx = _local(0, requires_grad=True)
        before = JOURNAL.count
        with wrapper_tensors(kind == "wrapper"):
            out = VIEWS[name](wrap(lx, SPEC))
        assert type(out) is cls, name
        entries = [e[1:3] for e in list(JOURNAL.entries)[before - JOURNAL.count:]] if JOURNAL.count > before else []
        (grad,) = torch.autograd.grad((unwrap(out) * torch.arange(unwrap(out).numel()).view_as(unwrap(out))).sum(), lx)
        results.append((unwrap(out).detach().clone(), out.spec, grad, JOURNAL.count - before, entries,
                        getattr(out, "_views_domain", None), getattr(out, "_replay", None) is not None))
    for got in results[:2]:
        want = results[2]
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2])
        assert got[3:] == want[3:], (got[3:], want[3:])


def test_a_convolution_whose_rows_stay_goes_straight_to_torch(monkeypatch):
    """A 1x1 convolution on the middle shard of 3 (no halo) and any convolution on one rank take the short path and
    equal the rule's, journaled alike (a multi-rank domain journals every convolution on every rank: ranks whose rows
    stay and ranks that fetch halos must agree); a 3x3 one on 3 ranks (halos to fetch) reaches the dispatcher."""
    one = DomainSpec(2, (2,), DomainComm(None, (0,), 0))
    w1, w3 = (torch.randn(4, 3, k, k, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in (1, 3))
    bias = torch.randn(4, dtype=torch.float64)
    cases = [(SPEC, w1, {}), (one, w3, {"padding": 1}), (one, w3, {"padding": "same"}), (one, w1, {"stride": (1, 2)})]
    counted, table = _Counted(DomainTensor._dispatcher), DomainTensor._short
    monkeypatch.setattr(DomainTensor, "_dispatcher", staticmethod(counted))
    for spec, w, kw in cases:
        outs = []
        for short in (True, False):
            monkeypatch.setattr(DomainTensor, "_short", table if short else {})
            counted.calls.clear()
            lx = _local(0, requires_grad=True)
            before = JOURNAL.count
            out = F.conv2d(wrap(lx, spec), w, bias, **kw)
            assert (F.conv2d in counted.calls) != short, (spec, kw, short)
            (grad,) = torch.autograd.grad(unwrap(out).sum(), lx)
            outs.append((unwrap(out).detach(), out.spec, grad, JOURNAL.count - before))
        assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] and torch.equal(outs[0][2], outs[1][2])
        assert outs[0][3] == outs[1][3] == (1 if spec.comm.size > 1 else 0)  # journaled alike on every path
    monkeypatch.undo()
    monkeypatch.setattr(DomainTensor, "_dispatcher", staticmethod(counted))
    counted.calls.clear()
    with pytest.raises(Exception):  # noqa: B017 - its halos need a group: the rule tried to fetch them
        F.conv2d(_field(0), w3, padding=1)
    assert F.conv2d in counted.calls
    counted.calls.clear()
    channels = wrap(_local(0), DomainSpec(1, (3,), one.comm))  # the channels sharded: the rule's contraction
    got = F.conv2d(channels, w1, bias)
    assert F.conv2d in counted.calls and torch.allclose(got.full_tensor(), F.conv2d(_local(0), w1, bias))
    unbatched = _local(0)[0]  # (C, H, W) sharded along H: a spatial dim, on either path
    for short in (True, False):
        monkeypatch.setattr(DomainTensor, "_short", table if short else {})
        got = F.conv2d(wrap(unbatched, DomainSpec(1, (2,), one.comm)), w3, bias, padding=1)
        assert torch.allclose(got.full_tensor(), F.conv2d(unbatched, w3, bias, padding=1)), short


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
def test_autograd_saves_what_the_dispatcher_s_walk_saves(name, monkeypatch):
    """The short path runs each op on aliases of the shards, as the dispatcher does: the backward's ops receive the
    same classes of tensors on either path (never a domain tensor autograd saved where the walk saves a plain one)."""
    one = DomainSpec(2, (2,), DomainComm(None, (0,), 0))
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    seen = []
    for short in (True, False):
        if not short:
            _full_path(monkeypatch)
        lx, ly = _local(0, requires_grad=True), _local(1, requires_grad=True)
        out = SAVING[name](wrap(lx, one), wrap(ly, one), w)
        mode = _BackwardTypes()
        with mode:
            torch.autograd.grad(unwrap(out).sum(), [lx, ly], allow_unused=True)
        seen.append(mode.seen)
    assert seen[0] == seen[1]
    assert not any(s.endswith(":DomainTensor") for s in seen[0]), seen[0]


def test_gradient_queries_are_the_dispatcher_s():
    """``.grad``, ``torch.autograd.grad`` and ``backward`` (``dispatch.grads``: answered as the whole tensor) never
    take the short path: ``.grad`` of a domain tensor is a domain tensor laid out like it."""
    for func in GRADIENT_CALLS:
        assert func not in DomainTensor._short, func
    xs = domain.shard(torch.randn(2, 3, 4, 5, dtype=torch.float64), dim=2).requires_grad_()
    (xs * xs).sum().backward()
    assert type(xs.grad) is DomainTensor and xs.grad.shape == xs.shape and xs.grad.spec == xs.spec
    assert torch.equal(xs.grad.full_tensor(), 2 * xs.full_tensor().detach())
