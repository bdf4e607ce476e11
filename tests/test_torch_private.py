"""mesh3d._torch_private's stand-ins for torch.compiler decorators (which import Dynamo's Python half at mesh3d's import)
behave as torch's own: held against ``torch.compiler.disable`` and ``assume_constant_result`` in the same run."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from mesh3d._torch_private import constant_in_compiled_graphs, never_traced


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def _callee(x: torch.Tensor) -> torch.Tensor:
    return _inner(x) + 1  # NOTE: a frame of its own when the callee runs with Dynamo on


def _graphs_and_frames(disabled, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(graphs compiled, frames compiled, the result) of a function calling ``disabled`` between two ops."""
    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def f(x):
        y = x.cos()
        z = disabled(y)
        return z.exp()

    out = f(x)
    return counter.frame_count, counter.op_count, out


def test_never_traced_breaks_the_graph_and_runs_eagerly_as_torch_compiler_disable_does():
    x = torch.randn(5, dtype=torch.float64)
    expected = torch.exp(_callee(torch.cos(x)))
    ours = _graphs_and_frames(never_traced("test: runs eagerly")(_callee), x)
    torchs = _graphs_and_frames(torch.compiler.disable(_callee, reason="test: runs eagerly"), x)
    assert ours[:2] == torchs[:2] == (2, 2), (ours[:2], torchs[:2])  # cos | eager callee | exp: two graphs, one op each
    assert torch.equal(ours[2], expected) and torch.equal(torchs[2], expected)
    assert never_traced("why")(_callee).__name__ == "_callee"


def test_constant_in_compiled_graphs_folds_the_result_as_assume_constant_result_does():
    calls = []

    def size_of(n: int) -> int:
        calls.append(n)
        return n * 3

    def counted(mark):
        torch._dynamo.reset()
        calls.clear()
        counter = CompileCounter()
        fn = mark(lambda n: size_of(n))

        @torch.compile(backend=counter, fullgraph=True)
        def f(x):
            return x + fn(4)

        out = f(torch.zeros(2))
        f(torch.ones(2))
        return out, counter.op_count, len(calls)

    ours, theirs = counted(constant_in_compiled_graphs), counted(torch.compiler.assume_constant_result)
    inlined = counted(lambda fn: fn)
    assert torch.equal(ours[0], torch.full((2,), 12.0)) and torch.equal(theirs[0], ours[0])
    # the call ran once, at trace time (a constant in the graph); inlined, its side effect is replayed on every call
    assert ours[1:] == theirs[1:] == (1, 1) and inlined[2] == 2, (ours[1:], theirs[1:], inlined)


class _Scale(torch.autograd.Function):
    """A Function of the setup_context form with a defaulted argument (torch binds it to fill the default in)."""

    @staticmethod
    def forward(x, factor, shift=0.0):
        return x * factor + shift

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None, None


class _Pair(torch.autograd.Function):
    """All positional, and ``*rest``: the calls the routed apply runs without binding them to the signature."""

    @staticmethod
    def forward(x, factor, *rest):
        return x * factor + sum(rest)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor, ctx.extra = inputs[1], len(inputs) - 2

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.factor, None, *([None] * ctx.extra))


def test_functions_run_alike_while_mesh3d_routes_function_apply():
    """While domain tensors live, mesh3d routes ``Function.apply`` (a library's Function on a domain tensor reaches its
    rules), and runs a call whose arguments are all given positionally without torch's signature binding: every form
    of call still gives the values and gradients the Function defines, inside ``torch.func.grad`` too."""
    from mesh3d import domain
    from mesh3d._torch_private.autograd import _positional_arity

    x = torch.arange(4.0, dtype=torch.float64)
    keep = domain.shard(torch.zeros(2, 3), dim=0)  # noqa: F841 - a live domain tensor: the routing is installed
    assert getattr(torch.autograd.Function.apply, "_mesh3d_routed", False)
    assert _positional_arity(_Pair) == (2, True) and _positional_arity(_Scale) == (-1, False)
    for call, value, slope in ((lambda t: _Pair.apply(t, 3.0), 3 * x, 3.0),
                               (lambda t: _Pair.apply(t, 3.0, 1.0, 2.0), 3 * x + 3, 3.0),
                               (lambda t: _Scale.apply(t, 2.0), 2 * x, 2.0),
                               (lambda t: _Scale.apply(t, 2.0, 5.0), 2 * x + 5, 2.0),
                               (lambda t: _Scale.apply(t, 2.0, shift=1.0), 2 * x + 1, 2.0)):
        leaf = x.clone().requires_grad_()
        out = call(leaf)
        out.sum().backward()
        assert torch.equal(out.detach(), value) and torch.equal(leaf.grad, torch.full_like(x, slope))
        assert torch.equal(torch.func.grad(lambda t: call(t).sum())(x), torch.full_like(x, slope))
