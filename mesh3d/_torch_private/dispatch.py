"""Private dispatch APIs: ATen operator overloads, dispatch modes, pytrees, storage identity.

Each function says which private name it touches and why no public API serves.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _python_dispatch, _pytree

__all__ = ["ARGUMENTS_TORCH_DROPS", "OpOverload", "OpOverloadPacket", "TRUTH_REDUCTIONS", "TorchDispatchMode",
           "argument_torch_dropped", "builtins_replaced_by", "custom_op_overload", "is_operator", "make_wrapper_tensor",
           "op_schema", "outside_dispatch_modes", "running_compiled_backward", "storage_key", "tree_flatten", "tree_map",
           "view_base"]



#: Functions whose Python body, in torch 2.13, drops an argument on its way to ``__torch_function__``: ``F.l1_loss``
#: hands ``handle_torch_function`` no ``weight`` (pytorch/pytorch#193003 fixes it), so a subclass sees the call
#: without it and would answer the unweighted loss.
ARGUMENTS_TORCH_DROPS: dict[Any, tuple[str, ...]] = {F.l1_loss: ("weight",)}


def argument_torch_dropped(func: Any, name: str) -> Any:
    """The ``name`` argument of the innermost ``func`` call on the stack, read from ``func``'s own frame, where
    ``ARGUMENTS_TORCH_DROPS`` says torch drops it; None for any other argument, or where no such frame runs (Dynamo
    tracing inlines it).

    Usage: ``weight = weight if weight is not None else argument_torch_dropped(func, "weight")`` in a loss rule

    Why private: ``sys._getframe`` and a frame's locals; no public API gives an argument torch did not pass on.
    """
    if name not in ARGUMENTS_TORCH_DROPS.get(func, ()) or torch.compiler.is_dynamo_compiling():
        return None
    code = getattr(func, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


#: The class of ATen operators (``torch.ops.aten.add.Tensor``), for type hints and ``isinstance``.
#: Why private: ``torch._ops`` is the only home of the class.
OpOverload = torch._ops.OpOverload

#: ``torch._is_all_true`` and ``torch._is_any_true``: ``torch.distributions`` validates an argument by reducing its
#: constraint's check with them (``Normal(xs, s).log_prob(v)``), so a domain tensor reaches them as torch functions.
#: Why private: they are what torch calls; mesh3d gives them the rules of ``all`` and ``any``.
TRUTH_REDUCTIONS = (torch._is_all_true, torch._is_any_true)

#: A mode that sees every ATen call below autograd: the planner's memory tracker and the attention kernels'
#: workspace measurement subclass it. Why private: torch's only dispatch-mode base class lives in
#: ``torch.utils._python_dispatch`` (``__torch_function__`` modes cannot see the allocations of a kernel call).
TorchDispatchMode = _python_dispatch.TorchDispatchMode

def make_wrapper_tensor(cls: type, shape: torch.Size, strides: tuple[int, ...], like: torch.Tensor,
                        requires_grad: bool = False, storage_offset: int = 0) -> Any:
    """A tensor of type ``cls`` with the given metadata and no storage: an instance of a wrapper subclass that holds its
    data in attributes (the wrapper domain tensor, ``mesh3d.domain.core.wrapped``).

    Why private: ``torch.Tensor._make_wrapper_subclass`` is how DTensor and every wrapper subclass in torch is made;
    torch 2.13 has no public constructor of a tensor without storage whose ATen calls reach ``__torch_dispatch__``.
    """
    layout = like.layout
    if storage_offset or requires_grad or layout is not torch.strided:
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, storage_offset=storage_offset,
                                                   dtype=like.dtype, device=like.device, layout=layout,
                                                   requires_grad=requires_grad)
    # NOTE: only the keywords that differ from the defaults: each costs about 0.1 us a tensor to parse
    return torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=like.dtype, device=like.device)


#: Flattening nested op arguments the way torch's own dispatch does (named tuples, dicts, dataclasses registered
#: with torch). Why private: torch 2.13 has no public pytree module (``torch.utils._pytree`` only).
tree_flatten = _pytree.tree_flatten
tree_map = _pytree.tree_map


def outside_dispatch_modes() -> Any:
    """A context in which the dispatch modes in force are set aside (a measurement of its own that an enclosing
    memory tracker must not count, then put back).

    Why private: ``torch.utils._python_dispatch._disable_current_modes``; torch has no public way to step outside
    the modes in force.
    """
    return _python_dispatch._disable_current_modes()


def storage_key(storage: torch.UntypedStorage) -> int:
    """A key that is the same for every tensor viewing ``storage`` while it lives (the C storage's address).

    Why private: ``UntypedStorage._cdata``; ``data_ptr()`` is 0 for every empty or meta storage, so it cannot tell
    two of those apart, and the memory trackers count meta storages.
    """
    return storage._cdata


def op_schema(func: OpOverload) -> Any:
    """The ATen schema of an operator (its arguments, returns and their aliasing).

    Why private: ``OpOverload._schema``; torch has no public accessor.
    """
    return func._schema


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (the root of its chain of views), or None.

    Why private: ``Tensor._base``; no public accessor.
    """
    return t._base


#: The class of ``torch.ops.ns.op`` (all overloads of one operator; calling it picks one in C++).
#: Why private: as ``OpOverload``.
OpOverloadPacket = torch._ops.OpOverloadPacket


def is_operator(func: Any) -> bool:
    """Whether ``func`` is an operator of ``torch.ops`` (an overload or a packet of overloads), ATen's or a library's.

    Why private: their classes live in ``torch._ops`` (``OpOverload``, ``OpOverloadPacket``).
    """
    return isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def custom_op_overload(func: Any) -> Any:
    """The ``torch.ops`` overload behind a ``torch.library.custom_op`` function, or None for anything else.

    Why private: a ``CustomOpDef`` keeps its operator in ``_opoverload``; no public accessor.
    """
    return func._opoverload if isinstance(func, torch.library.CustomOpDef) else None


def running_compiled_backward() -> bool:
    """Whether the autograd engine is running a compiled graph's backward (AOTAutograd's node) at this moment.

    Why private: ``torch._C._current_autograd_node``. A compiled graph's backward calls ATen operators on the tensors
    its forward saved, domain tensors among them, with sizes traced on the shard (the rules ran at trace time); torch
    2.13 runs the compiled forward with subclass dispatch off, but not its backward.
    """
    node = torch._C._current_autograd_node()
    return node is not None and node.name() == "CompiledFunctionBackward"


def builtins_replaced_by(func: Any) -> list[Any]:
    """The builtin torch functions that ``func``, a Python function some library put in their place in ``torch``'s
    namespace, stands for: ``[builtin select]`` for PyTorch Geometric's ``torch.select`` (it replaces
    ``torch.select`` and ``torch.index_select`` on import and calls the builtins inside). Empty for anything else.

    Why private: the builtins' home is ``torch._C._VariableFunctions``; once a library has replaced ``torch.select``,
    no public name reaches the builtin, which is what reaches ``__torch_function__``.
    """
    module = getattr(func, "__module__", None) or ""
    # NOTE: only a Python function can have been put there by a library; C methods and descriptors (torch.Tensor.add,
    # 840 of the rules) are skipped without scanning torch's namespace (0.2 s of every `import mesh3d.domain`).
    if not isinstance(func, types.FunctionType) or module == "torch" or module.startswith("torch."):
        return []  # NOTE: torch's own Python functions (torch.split, F.conv2d) are what callers reach
    found = []
    for name, value in vars(torch).items():
        builtin = getattr(torch._C._VariableFunctions, name, None)
        if value is func and builtin is not None and builtin is not func:
            found.append(builtin)
    return found
