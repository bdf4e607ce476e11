"""Private autograd and activation-checkpoint APIs: subclass dispatch off, checkpoint recomputation, backward.

Each function says which private name it touches and why no public API serves.
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any, ContextManager

import torch
from torch._functorch.utils import unwrap_dead_wrappers
from torch.distributed._composable import checkpoint

__all__ = ["checkpoint_module", "disable_torch_function_subclass", "function_apply_key", "linear_not_a_view",
           "own_output", "patch_checkpoint_recomputation", "route_autograd_function_calls", "run_autograd_function",
           "run_backward_from", "run_grad_from", "unpatch_checkpoint_recomputation", "unroute_autograd_function_calls"]


def checkpoint_module(module: object, context_fn: object | None = None) -> None:
    """Activation checkpointing on ``module`` without changing its parameter names.

    Why private: ``torch.distributed._composable.checkpoint`` is the only activation
    checkpointing API that keeps fully-qualified names (``checkpoint_wrapper`` inserts
    ``_checkpoint_wrapped_module.`` into every name, which breaks checkpoints keyed by name)
    and composes with ``fully_shard``. ``context_fn`` is ``torch.utils.checkpoint``'s: two context
    managers, for the forward and for the recomputation (the planner re-enters its modes there).
    """
    if context_fn is None:
        checkpoint(module)
    else:
        checkpoint(module, context_fn=context_fn)


def disable_torch_function_subclass():
    """Context manager under which tensor subclasses' ``__torch_function__`` is not called.

    Why private: ``torch._C.DisableTorchFunctionSubclass`` is what ``Tensor.__torch_function__``
    itself uses to run an op on a subclass's data without recursing; torch exposes no public
    equivalent. mesh3d's ``DomainTensor`` needs it to unwrap its local shard and to run
    metadata queries (``.shape``, ``.dtype``) on it.
    """
    return torch._C.DisableTorchFunctionSubclass()


def linear_not_a_view(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, the same values and storage, as a tensor autograd does not count as a view.

    Why: with a bias and a contiguous input of 3 or more dims, torch 2.13's ``F.linear`` runs one ``addmm`` on the
    input flattened to 2-D and returns a *view* of that product. FSDP2 warns for each wrapped module that returns a
    view (an in-place op on it, ``out += y``, would drop the pre-backward hook that re-gathers the parameters), so
    every ``nn.Linear`` unit called on a domain tensor of (batch, nodes or tokens, features) warned, and such an
    in-place op after it would run backward on freed parameters. The product is a temporary no other tensor holds and
    ``addmm``'s backward does not save it, so nothing is lost by not tracking the view.
    Why private: ``torch.ops.aten._unsafe_view``, the reshape torch's own ``matmul`` returns its N-D products with
    for the same reason (no public op reshapes without making an autograd view; ``clone()`` would copy).
    """
    out = torch.nn.functional.linear(input, weight, bias)
    if out._base is None or type(out) is not torch.Tensor or torch.compiler.is_dynamo_compiling():
        return out  # NOTE: a compiled graph's outputs are fresh tensors of its own
    return torch.ops.aten._unsafe_view(out, out.shape)


def own_output(t: object) -> object:
    """``t``, when it is an autograd view only in name, as a tensor autograd does not count as a view; else ``t``.

    A view only in name: it needs grad but its base has no autograd history, as ``DTensor.to_local()`` returns the
    DTensor's local tensor (its autograd function's result is ``view_as`` of it). torch's tensor-parallel styles hand
    a module's output back that way (an ``AsyncCollectiveTensor`` after a reduction: this waits for it), and FSDP2
    warns for a wrapped module returning a view (an in-place op on it would drop the pre-backward hook), as a model
    whose last module is tensor parallel (a head) does. The base is the dropped DTensor's, which nothing else writes.
    Why private: ``torch.ops.aten._unsafe_view`` and ``Tensor._base``, as ``linear_not_a_view``.
    """
    if not isinstance(t, torch.Tensor) or (type(t) is not torch.Tensor and type(t).__name__ != "AsyncCollectiveTensor"):
        return t  # NOTE: a domain tensor or a DTensor: an op's own result, never this view
    if not t.requires_grad or t._base is None or t._base.requires_grad or torch.compiler.is_dynamo_compiling():
        return t
    return torch.ops.aten._unsafe_view(t, t.shape)


def patch_checkpoint_recomputation(input_metadata: Callable[[torch.Tensor], Any],
                                    rebuild_input: Callable[[torch.Tensor, Any], torch.Tensor],
                                    forward_state: Callable[[], Callable[[], ContextManager]]) -> bool:
    """Make activation checkpointing recompute a region as its forward ran: each input the tensor subclass it was
    given, and the state ``forward_state`` captured at forward time re-entered around the recomputation.

    Why private: non-reentrant ``torch.utils.checkpoint`` keeps a region's inputs as saved tensors and recomputes
    through its frame (``_CheckpointFrame.save_inputs`` / ``get_inputs`` / ``recompute_fn``, torch 2.13); no public
    hook reaches them. Two things go wrong for a ``__torch_function__`` subclass without this:
    * under another checkpoint's saved-tensor hooks (a checkpointed module inside a checkpointed one) unpacking
      makes a new plain tensor: the subclass is lost and the region would be recomputed on the bare shard;
    * the recomputation runs in backward, outside the ``with`` blocks the forward ran in (mesh3d's attention mode),
      so it could take another path (torch's checkpoint then raises: other tensors saved than in forward).
    A region with such inputs is recomputed whole (no early stop). ``input_metadata(t)`` is kept beside each tensor
    input (None: nothing to rebuild) and ``rebuild_input(unpacked, metadata)`` turns the unpacked tensor back;
    ``forward_state()`` is called at forward time and returns the context manager factory entered around the
    recomputation. Returns whether it patched (False on a torch without these frame methods, or when already
    patched).
    """
    frame = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
    save_inputs, get_inputs = getattr(frame, "save_inputs", None), getattr(frame, "get_inputs", None)
    if save_inputs is None or get_inputs is None or getattr(save_inputs, "_mesh3d_wrapped", False):
        return False

    def save(self: Any, *args: Any) -> None:
        self._mesh3d_input_metadata = [input_metadata(a) if isinstance(a, torch.Tensor) else None for a in args]
        if any(meta is not None for meta in self._mesh3d_input_metadata):
            # NOTE: early stop ends a recomputation by raising from inside whichever op saves the last tensor; in a
            # multi-rank op that can be while its messages are in flight. Recompute the whole region instead.
            self.early_stop = False
        recompute_fn, state = self.recompute_fn, forward_state()

        def recompute_as_forward(*inputs: Any) -> None:
            with state():
                recompute_fn(*inputs)

        self.recompute_fn = recompute_as_forward
        save_inputs(self, *args)

    def get(self: Any) -> list:
        inputs = get_inputs(self)
        kept = getattr(self, "_mesh3d_input_metadata", None) or [None] * len(inputs)
        return [arg if meta is None else rebuild_input(arg, meta) for arg, meta in zip(inputs, kept)]

    save._mesh3d_wrapped = True  # type: ignore[attr-defined]
    save._mesh3d_originals = (save_inputs, get_inputs)  # type: ignore[attr-defined]
    frame.save_inputs, frame.get_inputs = save, get
    return True


def unpatch_checkpoint_recomputation() -> bool:
    """Undo ``patch_checkpoint_recomputation``: torch's own frame methods back. Returns whether it was patched.

    Why private: as above (the same frame methods). A region whose inputs were saved under the patch keeps its
    recompute function; its ``get_inputs`` is torch's from now on.
    """
    frame = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
    originals = getattr(getattr(frame, "save_inputs", None), "_mesh3d_originals", None)
    if originals is None:
        return False
    frame.save_inputs, frame.get_inputs = originals
    return True


def run_backward_from(tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], retain_graph: bool,
                      create_graph: bool, inputs: tuple[torch.Tensor, ...]) -> None:
    """The autograd engine's backward from ``tensors`` with ``grads`` (accumulating into ``.grad``), as
    ``torch.autograd.backward`` ends by calling it.

    Why private: ``torch.autograd.backward``'s Python part would read the outputs' shapes through the domain
    tensor's ``__torch_function__`` (or, given a plain alias, add an alias node to the graph): 30 us per step on a
    tiny compiled D=1 step, 3% of it (``DomainTensor.backward``). ``Variable._execution_engine.run_backward`` is what
    it calls; it checks each gradient's shape, dtype and device in C++.
    """
    torch.autograd.Variable._execution_engine.run_backward(
        tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def run_grad_from(outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], retain_graph: bool,
                  create_graph: bool, inputs: tuple[torch.Tensor, ...], allow_unused: bool) -> tuple:
    """The autograd engine's gradients of ``outputs`` (with ``grads``) with respect to ``inputs``, as
    ``torch.autograd.grad`` ends by calling it; None where an input was unused (``allow_unused``).

    Why private: as ``run_backward_from``. Calling ``torch.autograd.grad`` itself on domain tensors would come back to
    their ``__torch_function__``; calling it with that switched off would run every hook and backward function the
    engine meets with it switched off too, so a gradient hook's ops on a domain tensor would miss their rules.
    """
    return torch.autograd.Variable._execution_engine.run_backward(
        outputs, grads, retain_graph, create_graph, inputs, allow_unreachable=allow_unused, accumulate_grad=False)


#: torch's own ``Function.apply`` (a classmethod's function), read before anything replaces it.
_TORCH_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"].__func__


def function_apply_key(cls: type) -> Callable:
    """``cls.apply`` bound to torch's own ``Function.apply``: the same key however ``Function.apply`` is routed now
    (``route_autograd_function_calls`` installs its own while a domain tensor can exist, and removes it after).

    Why private: reads torch's ``Function.apply`` from the class's ``__dict__``, past the routing.
    """
    return types.MethodType(_TORCH_FUNCTION_APPLY, cls)


def route_autograd_function_calls(tensor_types: tuple[type, ...], handler: Callable[[type, tuple, dict], Any]) -> bool:
    """Send every ``torch.autograd.Function.apply`` call that has an argument of one of ``tensor_types`` (exactly) to
    ``handler(cls, args, kwargs)``; other calls run as before. Returns False if already installed.

    Why private: ``Function.apply`` does not consult ``__torch_function__``, so a library's Function on a domain
    tensor would run its forward's extension kernels on the shard and its backward on this rank's gradients, unseen
    (a back door). There is no public hook; this wraps the base class's ``apply`` (subclasses inherit it). The check
    is one ``type`` test per argument. Other calls run as torch runs them, past its binding of the arguments to
    ``forward``'s signature where none is missing (``_positional_arity``): it cost 45 us a call.
    """
    base = torch.autograd.Function
    if getattr(base.apply, "_mesh3d_routed", False):
        return False
    original = base.apply.__func__  # type: ignore[attr-defined]  # a classmethod's function
    # NOTE: weak keys: a Function class made per call (a closure's) goes with its last use
    complete: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def apply(cls, *args, **kwargs):
        if any(type(a) in tensor_types for a in args) or any(type(v) in tensor_types for v in kwargs.values()):
            return handler(cls, args, kwargs)
        if not kwargs and not torch._C._are_functorch_transforms_active():
            need = complete.get(cls)
            if need is None:
                need = complete[cls] = _positional_arity(cls)
            if len(args) == need[0] or (need[1] and len(args) > need[0]):
                # NOTE: what torch's apply does next, less binding the arguments to ``forward``'s signature (to fill
                # in defaults: none here): 45 of the 54 us of a call of a setup_context Function (2-core AMD EPYC)
                return _BASE_APPLY.__get__(None, cls)(*unwrap_dead_wrappers(args))
        return original(cls, *args, **kwargs)

    apply._mesh3d_routed = True  # type: ignore[attr-defined]
    apply._mesh3d_original = original  # type: ignore[attr-defined]
    base.apply = classmethod(apply)
    return True


#: ``torch.autograd.Function.apply`` below its Python layer: the C function that runs ``forward`` and records the node.
_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _positional_arity(cls: Any) -> tuple[int, bool]:
    """(how many positional arguments ``cls.forward`` takes, whether it takes more: ``*args``); (-1, False) where a
    call must be bound to its signature: keyword-only or defaulted parameters, or a forward taking ``ctx`` first (the
    old form, which torch's apply does not bind: it takes the same path)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return -1, False
    fixed = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if any(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params) or any(p.default is not p.empty for p in fixed):
        return -1, False
    if cls.setup_context == torch.autograd.function._SingleLevelFunction.setup_context:
        return -1, False  # NOTE: torch binds nothing for these (its own test): its own path costs the same
    return len(fixed), varargs


def unroute_autograd_function_calls() -> bool:
    """Undo ``route_autograd_function_calls``: torch's own ``Function.apply`` back. Returns whether it was routed.

    Why private: as above (the wrapped original of ``Function.apply``).
    """
    original = getattr(torch.autograd.Function.apply, "_mesh3d_original", None)
    if original is None:
        return False
    torch.autograd.Function.apply = classmethod(original)  # torch's own, as it was
    return True


def run_autograd_function(cls: Any, args: tuple, kwargs: dict) -> Any:
    """``cls.apply(*args, **kwargs)`` as torch runs it, past ``route_autograd_function_calls``.

    Why private: as above (the wrapped original of ``Function.apply``).
    """
    original = getattr(torch.autograd.Function.apply, "_mesh3d_original", None)
    return original(cls, *args, **kwargs) if original is not None else cls.apply(*args, **kwargs)


#: ``functorch_transform_active()``: whether a ``torch.func`` transform (grad, vjp, jacrev, vmap, ...) runs around the
#: call. Why private: ``torch._C._are_functorch_transforms_active`` is what ``torch.autograd.Function.apply`` itself
#: asks; torch has no public question for it. The C function itself (30 ns), as the wrappers ask it on every op.
functorch_transform_active = torch._C._are_functorch_transforms_active

#: ``with outside_transforms(): ...``: the ``torch.func`` transforms around the call set aside, so plain tensors made
#: inside stay plain (a question about metadata on meta tensors, ``domain.dispatch.view_semantics``; inside ``grad``
#: an op's meta result came back as the transform's wrapper, which has no storage to ask about). Why private:
#: ``torch._C._DisableFuncTorch`` is how torch's own code steps outside the transforms; torch has no public one.
outside_transforms = torch._C._DisableFuncTorch
