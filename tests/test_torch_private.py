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
