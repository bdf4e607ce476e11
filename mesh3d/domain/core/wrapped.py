"""The wrapper-subclass domain tensor (issue 64): what ``domain.shard`` and every rule make, by default.

Usage::

    xs = domain.shard(x, dim=2)               # a WrappedDomainTensor: no storage of its own, the shard inside
    loss = model(xs).sum(); loss.backward()
    with wrapper_tensors(False): ...          # the storage subclass inside (private; MESH3D_DOMAIN_WRAPPER=0: all)

What changes against the storage subclass (``mesh3d.domain.core.tensor``): the tensor's own metadata is the whole
tensor's, and it has no storage, so nothing below the rules can take this rank's shard for the whole tensor: C++ code
(an extension's ``at::sum``, TorchScript, ``torch.func``) reaches ``__torch_dispatch__``, the floor, which refuses
every op by name except the few the autograd engine itself runs on gradients laid out alike. Autograd tracks the
wrapper: every rule still runs on plain shards (``unwrap`` is a differentiable ``_ToLocal``, ``wrap`` a differentiable
``_FromLocal``), so gradients reaching hooks, ``.grad`` and ``torch.autograd.grad`` are domain tensors of the global
shape, answering every question (``g.norm()``) as the one-process gradient.

Compiled (``torch.compile``): a wrapper tensor is a traceable subclass (``__tensor_flatten__``), as DTensor is. Dynamo
records the model's ops on it without tracing mesh3d's code; the rules run when the graph is traced (Dynamo's fake run
of each op, then AOTAutograd's trace), on fake shards, and emit their exchanges as ``mesh3d::exchange_rows``
(``core.settings.traced``). A builtin that Dynamo records in place of a Python function of torch needs that
function's rule registered for it too (``F.pad``'s: ``_torch_private.PAD_BUILTIN``).

Inside ``torch.func``'s transforms (``grad``, ``vjp`` of a function that captures the domain tensor) the shards carry
the history, as the transform's own wrappers of them, and a wrapper tensor is a holder with none (``fresh_wrapper``,
``rebase``); a replicated result is its shard, so a loss reaches the transform as the tensor it tracks. A domain tensor
passed to the transform meets the floor. The default since 2026-12-05 (``MESH3D_DOMAIN_WRAPPER=0``: the storage one).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.compiler import is_compiling

from mesh3d._torch_private import (
    disable_torch_function_subclass, functorch_transform_active as under_torch_func, make_wrapper_tensor,
    run_autograd_function, tree_flatten, tree_map)
from mesh3d.domain.core.alike_ops import (
    ENGINE_OPS, alike_result, elementwise_aten, empty_in_order, laid_out_alike, same_layout)
from mesh3d.domain.core.settings import SETTINGS
from mesh3d.domain.core.shard_owners import SHARD_OWNERS, version_of
from mesh3d.domain.core.specs import AnySpec, DomainSpec, Layout
from mesh3d.domain.core.tensor import DomainTensor, dense_strides, global_shape_for, global_strides_for

__all__ = ["WrappedDomainTensor", "fresh_wrapper", "rebase", "shortcut_alias", "wrapper_tensors"]


@contextlib.contextmanager
def wrapper_tensors(on: bool = True) -> Iterator[None]:
    """Domain tensors made inside the block are wrapper tensors (``on``, the default) or storage tensors (private).

    Usage: ``with wrapper_tensors(): xs = domain.shard(x, dim=2)``
    """
    with SETTINGS.replaced(dataclasses.replace(SETTINGS.value, wrapper=on)):
        yield


# NOTE (both edges): forward(ctx, ...) without a separate setup_context: torch 2.13's Function.apply binds the
# arguments of a Function that has one with inspect.signature on every call (about 25 us each, a third of a wrapper
# op's host cost); torch.func's transforms, which would need setup_context, are refused by the floor anyway.
class _FromLocal(torch.autograd.Function):
    """A plain shard -> the wrapper tensor it is this rank's part of; backward hands the wrapper gradient's shard on."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: AnySpec) -> WrappedDomainTensor:
        ctx.set_materialize_grads(False)
        return _made_from(local, spec)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if grad is None:
            return None, None
        if not isinstance(grad, WrappedDomainTensor):
            raise TypeError(f"a plain gradient of shape {tuple(grad.shape)} reached a domain tensor's autograd edge: "
                            "gradients of domain tensors are domain tensors laid out like them; pass "
                            "torch.ones_like(output) (or a domain tensor of the output's layout) as the gradient")
        return grad._differentiable_local(), None


class _ToLocal(torch.autograd.Function):
    """The wrapper tensor -> its shard (a plain tensor sharing its memory); backward wraps the shard's gradient."""

    @staticmethod
    def forward(ctx: Any, wrapped: WrappedDomainTensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.spec = wrapped._spec
        if is_compiling():
            return wrapped._local.detach()  # NOTE: traced: no marks (Dynamo cannot make weakrefs)
        # NOTE: detach(), not a view: the output is a fresh autograd tensor sharing the shard's memory and version
        # counter, so a rule may write into it in place (a view made inside a Function may not be) and autograd
        # still sees every saved shard's version change
        alias = wrapped._local.detach()
        SHARD_OWNERS.mark(alias, wrapped)  # NOTE: read by _wrapped_or_owner, _made_from
        return alias

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return None if grad is None else fresh_wrapper(grad, ctx.spec)


class _Rebase(torch.autograd.Function):
    """``target`` now holds what ``written`` holds (an in-place op's result): its history becomes ``written``'s."""

    @staticmethod
    def forward(ctx: Any, target: WrappedDomainTensor, written: WrappedDomainTensor) -> WrappedDomainTensor:
        ctx.set_materialize_grads(False)
        target._local, target._spec, target._alias = written._local, written._spec, None
        target._seen_version = version_of(written._local)
        ctx.mark_dirty(target)
        return target

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[None, Any]:
        return None, grad


def rebase(target: WrappedDomainTensor, written: Any, check: bool = True) -> WrappedDomainTensor:
    """An in-place op's answer on wrapper tensors: ``target`` itself, holding ``written`` (the rule's result), with
    ``written``'s autograd history, as torch gives a tensor written in place.

    Usage: ``return rebase(args[0], result)`` (the dispatcher, for ops that write into their first argument)
    """
    if check and target._views_domain:
        raise NotImplementedError("an in-place write into a view of a domain tensor is made by "
                                  "mesh3d.domain.dispatch.writes (it rebases the tensor viewed too)")
    if written is target:
        return target
    if not isinstance(written, WrappedDomainTensor):
        raise TypeError(f"an in-place op on a domain tensor returned a {type(written).__name__}, not a domain tensor")
    with disable_torch_function_subclass():  # NOTE: a wrapper's own sizes are the whole tensor's: no dispatcher walk
        before, after = tuple(target.shape), tuple(written.shape)
    if after != before:
        raise RuntimeError(f"an in-place op would change a domain tensor's shape from {before} to {after}")
    if under_torch_func():  # NOTE: the shards carry the histories there (module docstring)
        target._local, target._spec, target._alias = written._local, written._spec, None
        return target
    # NOTE: past route_autograd_function_calls, which would only find this Function mesh3d's own and run it
    return run_autograd_function(_Rebase, (target, written), {})


def _wrapped_or_owner(local: torch.Tensor, spec: AnySpec) -> WrappedDomainTensor:
    """``wrap``'s answer under the switch: the wrapper tensor whose shard ``local`` is, where a rule handed its input's
    shard back unchanged (``x.contiguous()``, ``x.to(x.dtype)`` are ``x`` in torch: a write into one is a write into
    the other), else a new one (``fresh_wrapper``)."""
    if is_compiling():
        return fresh_wrapper(local, spec)
    owner = SHARD_OWNERS.owner(local)
    if owner is not None and (local is owner._local or local is owner._alias) and \
            (owner._spec is spec or owner._spec == spec):
        if version_of(local) != owner._seen_version:  # the rule wrote into it (F.relu(x, inplace=True) returns x)
            if local is owner._alias:
                rebase(owner, fresh_wrapper(local, spec), check=False)
            else:
                owner._seen_version = version_of(local)  # no history to rebase: the write was not recorded
        return owner
    return fresh_wrapper(local, spec)


def fresh_wrapper(local: torch.Tensor, spec: AnySpec) -> WrappedDomainTensor:
    """A new wrapper tensor holding ``local`` (its autograd edge leads to ``local``'s history).

    Usage: ``rebase(root, fresh_wrapper(alias, root.spec))`` (a written shard's new history)
    """
    if local.requires_grad and torch.is_grad_enabled():
        if under_torch_func():  # NOTE: no edge: the transform would wrap it (module docstring)
            return local if spec.layout is Layout.REPLICATED else _made_from(local, spec)
        out = run_autograd_function(_FromLocal, (local, spec), {})
        if not out._views_domain and not is_compiling() and SHARD_OWNERS.owner(local) is None:
            # NOTE: a fresh result: rules read ``local`` itself, not an alias through the new tensor's own edge (two
            # Python autograd edges per op, a wrapper gradient made and unmade in backward). Every gradient still meets
            # at ``local`` (hooks, retain_grad: ``shortcut_alias``); the history is this edge (_differentiable_local)
            SHARD_OWNERS.mark(local, out)  # NOTE: as __new__
            with disable_torch_function_subclass():
                out._alias_node = out.grad_fn
            out._alias = local
        return out
    return _made_from(local, spec)  # NOTE: no history to connect: the Function's cost (about 10 us) is not paid


def shortcut_alias(t: Any) -> torch.Tensor | None:
    """What rules read in place of ``t`` (made by ``fresh_wrapper``), where its whole gradient meets; else None.

    Usage: ``alias = shortcut_alias(h); (alias if alias is not None else h).register_hook(...)``
    """
    if type(t) is not WrappedDomainTensor or t._alias is None or t._alias_node is None:
        return None
    with disable_torch_function_subclass():
        return t._alias if t.grad_fn is t._alias_node else None


def _made_from(local: torch.Tensor, spec: AnySpec) -> WrappedDomainTensor:
    if is_compiling():
        return WrappedDomainTensor(local, spec)  # NOTE: traced: in-place writes into views are not replayed there
    # NOTE: a view rule's result: its shard is a view of a live wrapper's shard (each wrapper's shard and its
    # differentiable aliases are marked with their owner; read before this one's shard is). A mark whose owner is
    # gone says nothing: the user's own tensor, wrapped whole on one rank step after step, is no view
    views = _owned(local._base) or _owned(local)
    out = WrappedDomainTensor(local.detach() if local.requires_grad and not under_torch_func() else local, spec)
    out._views_domain = views
    return out


def _owned(local: torch.Tensor | None) -> bool:
    """Whether ``local`` is the shard (or a differentiable alias of it) of a wrapper tensor alive now."""
    return local is not None and SHARD_OWNERS.owner(local) is not None


class WrappedDomainTensor(DomainTensor):
    """A domain tensor with the whole tensor's metadata and no storage; its shard is ``to_local()`` (module docstring).

    Usage: ``with wrapper_tensors(): xs = domain.shard(x, dim=2)  # type(xs) is WrappedDomainTensor``
    """

    _local: torch.Tensor
    #: The whole tensor's sizes and strides, as made (what an element-wise result of the same shard shape reuses)
    _whole: torch.Size
    _strides: tuple[int, ...]
    #: Its storage offset, and whether its strides are dense (all but a view's, ``dispatch.relayout``)
    _offset: int = 0
    _dense = True
    _wraps = True
    #: Whether the shard is a view of another wrapper tensor's shard (the result of a view rule)
    _views_domain = False
    #: The shard's differentiable alias (``_differentiable_local``), once made
    _alias: torch.Tensor | None
    _alias_node: Any = None
    #: How a view was made from the tensor it views, ``(func, args, kwargs, index)`` (``dispatch.writes``)
    _replay: tuple | None = None
    #: The shard's version when this tensor's history was last set: a later one means a write through another tensor
    _seen_version: int
    #: Its query answers (``dispatch.query_answers.WRAPPED_QUERIES``, installed by ``mesh3d.domain``)
    _queries: Any = {}

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: AnySpec, requires_grad: bool = False,
                like: WrappedDomainTensor | None = None, layout: tuple | None = None) -> WrappedDomainTensor:
        offset = 0
        if layout is not None:  # NOTE: (strides, storage offset): a view's, as one process has it (core.relayout)
            whole, (strides, offset) = global_shape_for(local.shape, spec), layout
        elif like is not None and like._dense and local.shape == like._local.shape and \
                local.stride() == like._local.stride():
            whole, strides = like._whole, like._strides  # NOTE: an element-wise result: the sizes of its operand
        elif type(spec) is DomainSpec and spec.comm.size == 1:  # NOTE: one rank's shard is the whole, laid out as it is
            whole, strides, offset = local.shape, local.stride(), local.storage_offset()
        else:
            whole = global_shape_for(local.shape, spec)
            strides = global_strides_for(local, whole)
        out = make_wrapper_tensor(cls, whole, strides, local, requires_grad, offset)
        out._whole, out._strides = whole, strides
        if offset or layout is not None:  # NOTE: else the class's (0, dense): an attribute set costs 50 ns a tensor
            out._offset, out._dense = offset, dense_strides(whole, strides)
        if is_compiling():
            out._local, out._spec, out._alias, out._seen_version = local, spec, None, 0
            return out
        SHARD_OWNERS.mark(local, out)  # NOTE: read by _wrapped_or_owner, _made_from; alike_ops.wrapper_like as here
        out._local, out._spec, out._alias, out._seen_version = local, spec, None, version_of(local)
        return out

    def _differentiable_local(self) -> torch.Tensor:
        """The shard, connected to this tensor's autograd history where it has one (made once per tensor).

        NOTE: one alias serves every rule that reads this tensor (autograd sums their gradients at the alias): a
        ``_ToLocal`` per read cost about 10 us per op. An in-place write makes a new one (``_Rebase``)."""
        if is_compiling():
            return _ToLocal.apply(self) if torch.is_grad_enabled() else self._local
        if not torch.is_grad_enabled() or under_torch_func():
            return self._local
        with disable_torch_function_subclass():  # NOTE: read through the dispatcher, the flag cost a whole walk
            if not self.requires_grad:
                return self._local
            stale = version_of(self._local) != self._seen_version and self.grad_fn is not None
            moved = self._alias_node is not None and self.grad_fn is not self._alias_node  # a new history (dirty)
        if stale:
            self._remade()
        alias = None if moved else self._alias
        if alias is None:
            alias = self._alias = run_autograd_function(_ToLocal, (self,), {})  # NOTE: as in rebase
            self._alias_node = None
        return alias

    def own_memory(self) -> None:
        """Give this tensor a shard of its own, a copy of the one it has (which views another tensor's here): a result
        torch makes as a copy, whose shard only happens to alias on this rank (``dispatch.writes.record_views``)."""
        local = self._local.clone()
        SHARD_OWNERS.mark(local, self)  # NOTE: as __new__
        self._local, self._alias, self._views_domain, self._seen_version = local, None, False, version_of(local)

    def _remade(self) -> None:
        """This tensor's history made anew from the tensor it views, written into since (by another view of it or
        itself): autograd's answer to a read of a view after a write into its base. A tensor with a history that views
        no recorded one cannot be remade: refused, as reading it would miss the write's gradient."""
        replay = self._replay
        if replay is None:
            raise NotImplementedError(
                "a domain tensor read after its memory was written through another tensor (a view of it, or a tensor "
                "it views, written in place): its autograd history would miss the write. Write out of place "
                "(x = x + ...), or take the views after the write")
        func, args, kwargs, index = replay
        with wrapper_tensors():
            made = DomainTensor._dispatcher(func, (), args, kwargs)
        rebase(self, made if index is None else made[index], check=False)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[AnySpec, Any, int]]:
        """What ``torch.compile`` sees of a wrapper tensor: its shard, and as constants of the graph its spec, the
        domain settings in force and its storage offset (a view's, ``core.relayout``; its strides are the outer ones).

        NOTE: the settings too, because the rules read them while the graph is traced, where Dynamo guards nothing
        they read: with the spec alone, a graph compiled with ``domain.window_overlap`` on kept running with it after
        it was turned off (and so would an attention mode's). Dynamo guards this context on every call, so a change
        recompiles."""
        return ["_local"], (self._spec, SETTINGS.value, self._offset)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], context: tuple[AnySpec, Any, int], _outer_size: Any,
                             outer_stride: Any) -> WrappedDomainTensor:
        """The wrapper tensor ``__tensor_flatten__`` took apart (a compiled graph's input or output), laid out as it
        was (a view's strides and offset are the one-process view's, ``core.relayout``)."""
        out = WrappedDomainTensor(inner["_local"], context[0])
        if outer_stride is None or any(type(s) is not int for s in outer_stride) or \
                (tuple(outer_stride) == out._strides and context[2] == out._offset):
            return out
        return WrappedDomainTensor(inner["_local"], context[0], layout=(tuple(outer_stride), context[2]))

    def __deepcopy__(self, memo: dict) -> WrappedDomainTensor:
        """A copy with the same spec; a leaf keeps ``requires_grad`` as torch's deep copy of a leaf does."""
        return WrappedDomainTensor(copy.deepcopy(self._local, memo), self._spec, requires_grad=self.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:
        """The floor: every ATen op that reaches a wrapper tensor below the rules.

        NOTE: what arrives here was not called through Python's torch functions (those take the rules): the autograd
        engine summing gradients, or C++ code (an extension, TorchScript, torch.func's transforms) that would run on
        the shard as if it were the whole tensor. Only ENGINE_OPS and element-wise ops (``alike_ops``) on tensors laid
        out alike run; all else is refused by name.
        """
        alike = elementwise_aten(func)
        if alike and not kwargs:
            like = laid_out_alike(args, WrappedDomainTensor)
            if like is not None and (alike == 1 or args[0] is like):  # NOTE: the common case, nothing nested
                out = func(*[a._local if type(a) is WrappedDomainTensor else a for a in args])
                if alike == 2:  # NOTE: autograd recorded the write on the wrapper: its history is the tensor's own,
                    # and a rule reading it next needs an alias of the shard on that history
                    like._seen_version, like._alias = version_of(like._local), None
                    return like
                return alike_result(WrappedDomainTensor, func, out, like)
        kwargs = kwargs or {}
        # NOTE: pytree costs tens of us a call: only for nested arguments or tensors among the keywords
        # (``ones_like``'s are dtype, layout, device and memory format)
        nested = any(isinstance(a, (list, tuple, dict)) for a in args) or \
            any(isinstance(v, (list, tuple, dict, torch.Tensor)) for v in kwargs.values())
        flat = tree_flatten((args, kwargs))[0] if nested else args
        wrapped = [a for a in flat if isinstance(a, WrappedDomainTensor)]
        plain = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, WrappedDomainTensor)]
        if wrapped and func not in ENGINE_OPS and alike == 1 and same_layout(wrapped) and \
                not any(p.ndim for p in plain):
            # NOTE: an element-wise op of tensors laid out alike (and 0-d values, the same on every rank) is the
            # whole answer's shards, whoever calls it: the fast path's forward, autograd's backward of it, C++ code
            out = func(*_shards_of(args, nested), **(tree_map(_shard_of, kwargs) if nested else kwargs))
            return alike_result(WrappedDomainTensor, func, out, wrapped[0])
        if func not in ENGINE_OPS or plain or not same_layout(wrapped):
            message = (
                f"{func} reached a domain tensor below mesh3d's rules (called from C++: an extension, TorchScript, "
                "torch.func or another dispatch-level caller), where it would see only this rank's shard as the whole "
                "tensor: mesh3d refuses it. Call it through Python torch functions, or on x.full_tensor() (the whole "
                "tensor) or x.to_local() (this rank's shard) explicitly. Under torch.func.grad/vjp, capture the domain "
                "tensor in the function instead of passing it to the transform")
            # NOTE: TorchScript's interpreter re-raises an op's Python error with its message dropped (torch 2.13:
            # "RuntimeError: " and nothing after): the warning is what names the op there
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            raise NotImplementedError(message)
        spec = wrapped[0]._spec
        if func is torch.ops.aten.new_empty_strided.default:
            # NOTE: AccumulateGrad's layout contract: a gradient strided otherwise than its leaf is copied into a new
            # tensor of the leaf's (global) sizes and strides; the shard of that is a shard-sized one in their order
            return WrappedDomainTensor(empty_in_order(args[0]._local.shape, args[2], args[0]._local), spec,
                                       layout=(tuple(args[2]), 0))
        out = func(*_shards_of(args, nested), **(tree_map(_shard_of, kwargs) if nested else kwargs))
        if func.overloadpacket in (torch.ops.aten.add_, torch.ops.aten.copy_, torch.ops.aten.zero_,
                                   torch.ops.aten.detach_):
            return args[0]
        return WrappedDomainTensor(out, spec)


def _shards_of(args: tuple, nested: Any) -> Any:
    return tree_map(_shard_of, args) if nested else [_shard_of(a) for a in args]


def _shard_of(a: Any) -> Any:
    return a._local if isinstance(a, WrappedDomainTensor) else a


DomainTensor._from_local = staticmethod(_wrapped_or_owner)
