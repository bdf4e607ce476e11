"""Private torch.compile APIs: subclasses in compiled graphs, ordered custom ops, autograd inside custom ops.

Each function says which private name it touches and why no public API serves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.output_graph import OutputGraph
from torch._library.effects import EffectType

__all__ = [
    "autograd_inside_custom_op",
    "keep_in_program_order",
    "let_compiled_graphs_take_function_subclasses",
    "run_compiled_graphs_without_subclass_dispatch",
]


def let_compiled_graphs_take_function_subclasses() -> None:
    """Skip AOTAutograd's first-call aliasing check of custom ops, which refuses ``__torch_function__`` subclasses.

    Why private: a compiled graph called with a ``DomainTensor`` runs its ops on the real input, a
    ``__torch_function__`` subclass. On its first call AOTAutograd runs them under a debug dispatch mode
    (``_AnalyzeCustomOpInputOutputMode``) that returns ``NotImplemented`` for any tensor type other than
    ``torch.Tensor``, so the call fails (torch 2.13). ``torch._functorch.config.check_custom_op_aliasing``
    turns that debug check off; mesh3d's one custom op (``mesh3d::exchange_rows``) returns fresh buffers only.
    """
    torch._functorch.config.check_custom_op_aliasing = False


def keep_in_program_order(op: Any) -> None:
    """Mark the custom op ``op`` as having an ordered side effect: a compiled graph neither reorders, merges nor drops it.

    Why private: every domain rank must post its exchanges in the same order, and an op whose outputs are unused
    (a rank that receives nothing) must still send. ``CustomOpDef.register_effect`` is public, but the only effect
    type it takes, ``EffectType.ORDERED``, lives in the private ``torch._library.effects``.
    """
    op.register_effect(EffectType.ORDERED)


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
