"""Private torch.compile APIs: subclasses in compiled graphs, ordered custom ops, autograd inside custom ops.

Each function says which private name it touches and why no public API serves.

NOTE: nothing here imports Dynamo's Python half (``torch._dynamo``) or the tracing stack (fake tensors, proxy tensors,
symbolic shapes, sympy) at import: that took 1.1 s of every process that imports mesh3d (every rank, launcher and CLI
call), most of which never compile. Its C half (``torch._C._dynamo``) is loaded with torch; the rest is imported
where a trace is running, and so loaded already.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy, set_eval_frame

__all__ = [
    "PAD_BUILTIN",
    "autograd_inside_custom_op",
    "call_without_compiling",
    "constant_in_compiled_graphs",
    "data_dependent_errors",
    "keep_in_program_order",
    "let_compiled_graphs_take_function_subclasses",
    "never_compiled_alone",
    "never_traced",
    "random_draws_saved_under_traced_checkpoints",
    "run_compiled_graphs_without_subclass_dispatch",
    "saved_under_traced_checkpoints",
]


#: ``F.pad``'s builtin. ``torch.compile`` records it in a graph in place of ``F.pad`` (Dynamo inlines the Python
#: function), so a traceable subclass (the wrapper domain tensor) meets it at trace time and pad's rule is registered
#: for it too. Why private: it lives in ``torch._C._nn``; no public name reaches it.
PAD_BUILTIN = torch._C._nn.pad


def let_compiled_graphs_take_function_subclasses(take: bool = True) -> bool:
    """Skip AOTAutograd's first-call aliasing check of custom ops, which refuses ``__torch_function__`` subclasses.

    Why private: a compiled graph called with a ``DomainTensor`` runs its ops on the real input, a
    ``__torch_function__`` subclass. On its first call AOTAutograd runs them under a debug dispatch mode
    (``_AnalyzeCustomOpInputOutputMode``) that returns ``NotImplemented`` for any tensor type other than
    ``torch.Tensor``, so the call fails (torch 2.13). ``torch._functorch.config.check_custom_op_aliasing``
    turns that debug check off; mesh3d's one custom op (``mesh3d::exchange_rows``) returns fresh buffers only.
    ``take=False`` turns it back on. Returns whether it was off before.
    """
    from torch._functorch import config  # noqa: PLC0415 (deferred)

    before = not config.check_custom_op_aliasing
    config.check_custom_op_aliasing = not take
    return before


def keep_in_program_order(op: Any) -> None:
    """Mark the custom op ``op`` as having an ordered side effect: a compiled graph neither reorders, merges nor drops it.

    Why private: every domain rank must post its exchanges in the same order, and an op whose outputs are unused
    (a rank that receives nothing) must still send. ``CustomOpDef.register_effect`` is public, but the only effect
    type it takes, ``EffectType.ORDERED``, lives in the private ``torch._library.effects``.
    """
    from torch._library.effects import EffectType  # noqa: PLC0415 (deferred)

    op.register_effect(EffectType.ORDERED)


def data_dependent_errors() -> tuple[type[Exception], ...]:
    """What fake tensors raise where an op needs its inputs' values (``int(t.max())``, a ``bool`` of a comparison) or
    has an output whose size depends on them (``nonzero``, ``bincount``), while ``torch.compile`` traces on them.

    Usage (while a trace runs: the tracing stack is loaded): ``except data_dependent_errors() as e:``

    Why private: the exception types of ``torch._subclasses.fake_tensor``; torch has no public name for them.
    """
    from torch._subclasses import fake_tensor  # noqa: PLC0415 (deferred)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: PLC0415 (deferred)

    return (GuardOnDataDependentSymNode, fake_tensor.DataDependentOutputException,
            fake_tensor.DynamicOutputShapeException)


def traced_graph_input_with_history(t: torch.Tensor) -> bool:
    """Whether ``t``, met while Dynamo traces, is its fake of a graph input that is not a leaf: one with a gradient
    history in eager code, which the trace does not see.

    Why private: Dynamo fakes such an input as a tensor whose ``grad_fn`` is ``torch._C._functions.DelayedError``'s
    node (``meta_utils._backward_error``), so that it is not a leaf; no public API tells an input from the trace's own
    tensors (which have real histories)."""
    node = t.grad_fn
    return node is not None and type(node).__name__ == "Error"


def never_compiled_alone(fn: Any) -> Any:
    """Make Dynamo run ``fn``'s frame eagerly when ``fn`` is entered from eager code (the functions it calls are treated
    as usual); traced inside a compiled frame it is still inlined as before. Returns ``fn``.

    Why private: ``DomainTensor.__torch_function__`` means something only inlined in the trace of the model code that
    called the op. Where that trace breaks, the op is re-run eagerly, and Dynamo would compile it as a frame of its
    own, once per call signature, until its recompile limit (a warning, and compile time for nothing).
    ``torch.compiler.disable`` would also stop the inlining. ``torch._dynamo.eval_frame.set_code_exec_strategy`` sets
    what the eval-frame callback does with one code object's frames without touching inlining (``torch._dynamo.skip``
    does the same but marks the function, which stops the inlining too).
    """
    set_code_exec_strategy(getattr(fn, "__func__", fn).__code__,
                           _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    return fn


_F = TypeVar("_F", bound=Callable[..., Any])


def never_traced(reason: str) -> Callable[[_F], _F]:
    """``torch.compiler.disable(fn, reason=reason)``: a compiled model's trace breaks at a call of ``fn``, which runs
    eagerly, Dynamo off for every frame it runs (unless one calls a ``torch.compile``d function).

    Usage: ``@never_traced("mesh3d: runs eagerly")`` on a module-level function.

    Why private: ``torch.compiler.disable`` imports Dynamo's Python half (``torch._dynamo``, 0.7 s) when it decorates,
    at mesh3d's import. This is what it does for a function, from the C half: a wrapper that turns the eval-frame
    callback off (``set_eval_frame``), whose own frames Dynamo skips (``set_code_exec_strategy``), marked with the
    attributes Dynamo reads to break its trace there (``_torchdynamo_disable``, its message, the original callable).
    """
    def wrap(fn: _F) -> _F:
        run = _eagerly(fn)
        run._torchdynamo_disable = True  # type: ignore[attr-defined]
        run._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
        run._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
        return run

    return wrap


def _eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    return run


never_compiled_alone(_eagerly(lambda: None))  # NOTE: every wrapper's frames share this code: Dynamo skips them


def constant_in_compiled_graphs(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result(fn)``: a compiled graph takes what ``fn`` returns at trace time as a
    constant. Returns ``fn``.

    Usage: ``@constant_in_compiled_graphs`` on a function whose result depends on its arguments' metadata alone.

    Why private: ``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (0.7 s) to set one attribute on
    ``fn``, ``_dynamo_marked_constant``, which Dynamo reads when it meets a call of ``fn``.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def call_without_compiling(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with Dynamo's frame evaluation off: no frame it runs is compiled, unless it calls a
    ``torch.compile``d function (which turns it on for itself). For code that only ever runs eagerly.

    Why private: ``torch.compiler.disable`` does this through a wrapper costing 0.3 us a call on this CPU (stance
    checks, a context object); on every eager op of a domain tensor that is 3-6 % of the host path. This is its core,
    ``torch._C._dynamo.eval_frame.set_eval_frame``: about 0.04 us. (A code strategy skipping the callees recursively,
    as ``never_compiled_alone`` sets for one frame, left FSDP2-wrapped blocks of ``Plan(compile=...)`` never compiled:
    tests/test_domain_compile.py.)
    """
    prior = set_eval_frame(None)
    try:
        return fn(*args)
    finally:
        set_eval_frame(prior)


never_compiled_alone(call_without_compiling)  # NOTE: called from a frame Dynamo skips, it would be compiled itself


def autograd_inside_custom_op() -> Any:
    """A context in which a custom op's implementation records autograd (``torch.autograd.grad`` inside it works).

    Why private: an op without autograd of its own runs below the Autograd dispatch key, which stays excluded in the
    thread's dispatch state for the call; ``torch.enable_grad`` does not lift that. ``mesh3d::sharded_sdpa_backward``
    recomputes the attention with autograd inside the op (mesh3d/domain/attention/compiled.py). ``_ForceDispatchKeyGuard``
    sets the thread's dispatch key sets for the block: the same, less the autograd keys.
    """
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "AutogradNestedTensor", "AutogradFunctionality"):
        if hasattr(torch._C.DispatchKey, name):
            exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def run_compiled_graphs_without_subclass_dispatch() -> bool:
    """On a torch older than 2.13, make Dynamo run each compiled graph with ``__torch_function__`` subclass dispatch
    off, as torch 2.13 itself does for a graph that inlined a subclass's ``__torch_function__``. Returns whether it
    patched anything (False on 2.13 and later). Not called by mesh3d: for a script on an older torch, such as the one
    a GPU image ships (``scripts/gpu_compile.py``).

    Why private: torch 2.11 calls the compiled graph with the domain tensors themselves, so an Inductor extern kernel
    on a graph input (``extern_kernels.convolution`` on CUDA, ``extern_kernels.mm``) re-enters the dispatcher at run
    time with a torch function the rules already handled at trace time. The graph comes back from Dynamo's private
    ``OutputGraph.call_user_compiler``; this wraps what it returns.
    """
    from torch._dynamo.output_graph import OutputGraph  # noqa: PLC0415 (deferred)

    if torch.__version__ >= (2, 13) or getattr(OutputGraph.call_user_compiler, "_mesh3d_wrapped", False):
        return False
    call_user_compiler = OutputGraph.call_user_compiler

    def wrapped(self: Any, gm: Any, example_inputs: Any) -> Any:
        compiled = call_user_compiler(self, gm, example_inputs)

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                return compiled(*args, **kwargs)

        return run

    wrapped._mesh3d_wrapped = True  # type: ignore[attr-defined]
    OutputGraph.call_user_compiler = wrapped
    return True


@contextlib.contextmanager
def saved_under_traced_checkpoints() -> Iterator[None]:
    """The graph nodes the block traces are saved for backward, never recomputed, inside an activation checkpoint.

    Why private: ``torch.compile`` of a ``torch.utils.checkpoint`` region tags every node it traces there
    ``recompute=PREFER_RECOMPUTE`` (``_CachingTorchDispatchMode``, after each op), and Inductor's partitioner then
    recomputes an effectful op's chain in backward (torch 2.13: ``force_save_effectful_ops`` spares user-checkpointed
    regions), which its effect-token unlifting cannot compile ("num_erased_outs 2 != expected 1") and which would
    replay an exchange with peers. The nodes of the block are re-tagged ``MUST_SAVE`` through the tracer's graph
    (``proxy_tensor.get_proxy_mode``): no public API sets a traced op's checkpoint policy from inside the region.
    Outside a trace, or a traced region without checkpointing, nothing changes.
    """
    # NOTE: not while Dynamo traces (the storage subclass's rules): no graph of nodes is being built then
    proxy = _proxy_mode()
    if proxy is None:
        yield
        return
    from torch.utils.checkpoint import CheckpointPolicy  # noqa: PLC0415 (deferred)

    graph = proxy.tracer.graph
    before = len(graph.nodes)
    yield
    for node in itertools.islice(reversed(graph.nodes), len(graph.nodes) - before):
        if node.meta.get("recompute") is not None:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


#: Per traced graph, the last node ``random_draws_saved_under_traced_checkpoints`` has looked at.
_RANDOM_SCANNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def random_draws_saved_under_traced_checkpoints() -> None:
    """Every random draw traced so far inside an activation checkpoint of the graph being traced is saved for
    backward, never recomputed: the draws of the region (mesh3d's domain masks and the user's own ``torch.rand``).

    Why private: as ``saved_under_traced_checkpoints`` (no public API sets a traced op's checkpoint policy from inside
    the region). Why at all: torch 2.13 recomputes a checkpointed region's random ops through
    ``run_and_save_rng_state``/``run_with_rng_state``, and Inductor schedules those in another order than the program's,
    so two draws in one region (dropout2d's mask and a drop-path ``torch.rand``) take each other's numbers: measured in
    one process with plain tensors, Inductor with ``fallback_random=True`` differs from eager from the third of six
    steps, and equals it when a selective checkpoint policy saves the random ops. A domain tensor's compiled step is
    held to eager's draws, so mesh3d saves them; nodes outside checkpoints, and Dynamo's own tracing, are left alone.
    """
    proxy = _proxy_mode()
    if proxy is None:
        return
    from torch.utils.checkpoint import CheckpointPolicy  # noqa: PLC0415 (deferred)

    graph = proxy.tracer.graph
    seen = _RANDOM_SCANNED.get(graph)
    for node in reversed(graph.nodes):
        if node is seen:
            break
        if node.meta.get("recompute") is not None and \
                torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    if len(graph.nodes):
        _RANDOM_SCANNED[graph] = next(iter(reversed(graph.nodes)))


def _proxy_mode() -> Any:
    """The proxy mode of the graph AOTAutograd or ``make_fx`` is tracing now, else None (Dynamo's own trace builds no
    graph of nodes)."""
    if not torch.compiler.is_compiling() or torch.compiler.is_dynamo_compiling():
        return None
    from torch.fx.experimental.proxy_tensor import get_proxy_mode  # noqa: PLC0415 (deferred)

    return get_proxy_mode()
