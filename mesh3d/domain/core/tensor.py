"""DomainTensor: a tensor sharded over the ``domain`` axis that answers every question as the whole tensor does.

Usage::

    from mesh3d import domain
    xs = domain.shard(x, dim=2)          # a DomainTensor: this rank holds rows [offset, offset + local)
    xs.shape, xs.numel(), len(xs)        # the WHOLE tensor's: exactly what x.shape, x.numel(), len(x) say
    xs.to_local(), xs.local_shape        # this rank's shard (a plain tensor) and its shape
    y = conv(xs)                         # nn.Conv2d / F.conv2d: halo exchange, one-process answer
    y.full_tensor()                      # differentiable gather

The contract is DTensor's: metadata is global (``shape``, ``size()``, ``numel()``, ``nelement()``, ``len()``,
``stride()``), so model code that computes with sizes gets the one-process answer and every domain rank
takes the same branch; the shard is ``to_local()``. Storage and autograd are local: a DomainTensor's data
*is* its shard, so autograd runs on local tensors and every op rule's adjoint is a local one plus the
exchanges it declares. The ``DomainSpec`` says which dim is sharded and every rank's size along it; a spec
with ``dim=None`` marks a value replicated over the domain (results of global reductions). Ops are
intercepted with ``__torch_function__`` (so ``nn.Conv2d`` and ``F.conv2d`` are both covered and no torch
function is patched); each op needs a rule in ``mesh3d.domain.dispatch.registry``, and an op with no rule raises
``NotImplementedError`` naming it: never a silently wrong local answer.

NOTE (the mechanism): a ``__torch_function__`` subclass with global answers, not a ``__torch_dispatch__`` wrapper
subclass as DTensor. The wrapper would move autograd to the global level and every rule to ATen; the
``__torch_function__`` subclass keeps ~50 rule families whose local adjoints are tested, and Dynamo traces it whole,
dispatcher and rules (docs/domain.md, "torch.compile").
"""

from __future__ import annotations

import copy

from typing import Any

import torch
from torch.compiler import is_dynamo_compiling

from mesh3d._torch_private import (
    call_without_compiling, disable_torch_function_subclass, functorch_transform_active, never_compiled_alone,
    run_backward_from, view_base)
from mesh3d.domain.core.settings import SETTINGS
from mesh3d.domain.core.specs import AnySpec, DomainSpec, Layout, sharded_dims

__all__ = ["DomainTensor", "adopt", "dense_strides", "detach_in_place", "global_shape_for", "global_shape_of",
           "global_strides_for", "is_wrapper", "local_shape", "size_of", "storage_view", "unwrap", "wrap", "wrap_anew"]


def wrap(local: torch.Tensor, spec: AnySpec) -> DomainTensor:
    """View ``local`` (a plain tensor, autograd history kept) as a DomainTensor with ``spec``.

    By default (``mesh3d.domain.core.wrapped``) a wrapper tensor whose autograd edge leads to ``local``.
    """
    if SETTINGS.value.wrapper:
        return DomainTensor._from_local(local, spec)
    return storage_view(local, spec)


def wrap_anew(local: torch.Tensor, spec: AnySpec) -> DomainTensor:
    """``wrap``, always a new domain tensor: ``domain.shard``'s and ``from_local``'s of a tensor held whole (one rank).

    NOTE: ``wrap`` hands back the live wrapper whose shard ``local`` is (a rule's ``x.contiguous()`` is ``x``): there,
    sharding one tensor twice gave one tensor, whose gradients the two uses then summed (``ys.grad`` held ``xs``'s)."""
    return wrap(local.view_as(local) if local.requires_grad else local.detach(), spec)


def storage_view(local: torch.Tensor, spec: AnySpec) -> DomainTensor:
    """A storage domain tensor viewing ``local`` (whichever kind ``wrap`` makes): what an op writing into a wrapper
    tensor runs on (``mesh3d.domain.dispatch.dispatcher``).

    Usage: ``stand_in = storage_view(unwrap(xs), xs.spec)``
    """
    with disable_torch_function_subclass():
        out = local.as_subclass(DomainTensor)
    out._spec = spec
    return out


def adopt(fresh: torch.Tensor, spec: AnySpec, keep: tuple = ()) -> DomainTensor:
    """Turn ``fresh`` (a plain tensor an op rule just computed) into a DomainTensor itself, not a view of it.

    Why not ``wrap``: ``as_subclass`` returns an alias *view*, and an in-place op on a view drops
    the autograd hooks registered on it. FSDP2 registers its pre-backward hook (which re-gathers
    the parameters for backward) on each module's output, so ``ReLU(inplace=True)`` after an
    FSDP-wrapped conv would run backward on freed parameters. Changing the class of the fresh
    result keeps the op's own autograd node. Tensors a caller may still hold as plain tensors
    (leaves that need grad, parameters, anything in ``keep``) are wrapped as views instead.
    """
    if SETTINGS.value.wrapper or is_dynamo_compiling() or type(fresh) is not torch.Tensor or (fresh.is_leaf and fresh.requires_grad) \
            or any(fresh is k for k in keep):
        # NOTE: Dynamo cannot set ``__class__``; a compiled graph's outputs are fresh tensors of its own anyway.
        return wrap(fresh, spec)
    fresh.__class__ = DomainTensor
    fresh._spec = spec
    return fresh


def is_wrapper(t: Any) -> bool:
    """Whether ``t`` is a wrapper domain tensor (``mesh3d.domain.core.wrapped``, the default kind).

    Usage: ``if is_wrapper(x): ...``

    NOTE: the class's attribute, not the tensor's: Dynamo (torch 2.13) cannot read a class attribute through a traced
    tensor subclass (a graph break on every op), and reads it on the class.
    """
    return isinstance(t, DomainTensor) and type(t)._wraps


def local_shape(t: torch.Tensor) -> torch.Size:
    """The shape of ``t``'s storage: a domain tensor's shard, a plain tensor's own shape.

    Usage: ``rows = local_shape(xs)[xs.spec.dim]``
    """
    if is_wrapper(t):
        return t._local.shape  # type: ignore[attr-defined]  # a wrapper's shard
    with disable_torch_function_subclass():
        return t.shape


def global_shape_of(x: DomainTensor) -> torch.Size:
    """The whole tensor's shape: the local shape with each sharded dim's length summed over the domain.

    Usage: ``global_shape_of(xs) == xs.shape``
    """
    return global_shape_for(local_shape(x), x._spec)


def global_shape_for(local: torch.Size, spec: AnySpec) -> torch.Size:
    """The whole tensor's shape for a shard of shape ``local`` laid out by ``spec``.

    Usage: ``global_shape_for(shard.shape, spec)``
    """
    shape = list(local)
    if spec.layout in (Layout.BLOCKS, Layout.TOKENS):
        return spec.global_shape(shape)  # type: ignore[attr-defined]
    if spec.dim is not None:
        shape[spec.dim] = sum(spec.sizes) * spec.outer  # type: ignore[union-attr]
    return torch.Size(shape)


def global_strides_for(local: torch.Tensor, whole: torch.Size) -> tuple[int, ...]:
    """Strides of the whole tensor laid out in the shard ``local``'s memory order (contiguous, channels-last, ...).

    Usage: ``global_strides_for(shard, global_shape_for(shard.shape, spec))``

    Dims the shard expands (stride 0, length > 1) keep stride 0. A zero stride on a dim of an empty shard is only
    the product with its zero length: such dims are outermost, as they are in the shard's peers.
    """
    if type(local) is torch.Tensor:  # NOTE: a plain shard (the common case): no subclass dispatch to turn off
        if local.is_contiguous() and local.numel():  # NOTE: row-major (an empty shard's order is the one below)
            return _contiguous_strides(whole)
        strides_here, sizes = local.stride(), local.shape
    else:
        with disable_torch_function_subclass():
            strides_here, sizes = local.stride(), local.shape
    expanded = {d for d in range(len(whole)) if strides_here[d] == 0 and sizes[d] > 1} if 0 not in sizes else set()
    # Outermost first, as in memory. torch computes an empty tensor's strides with each length clamped to 1, so
    # an empty dim ties with the dim just outside it: in a tie the empty dim is the inner one.
    order = sorted((d for d in range(len(whole)) if d not in expanded),
                   key=lambda d: (strides_here[d] != 0, -strides_here[d], sizes[d] == 0, d))
    strides, step = [0] * len(whole), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(whole[d], 1)
    return tuple(strides)


def dense_strides(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` cover a tensor of ``sizes`` without gaps or overlaps, in some order of the dims (torch's
    ``is_non_overlapping_and_dense``). Usage: ``dense_strides((2, 3), (1, 2))  # True``"""
    if 0 in sizes:
        return True
    step = 1
    for stride, size in sorted((s, n) for n, s in zip(sizes, strides) if n != 1):
        if stride != step:
            return False
        step *= size
    return True


def _contiguous_strides(whole: torch.Size) -> tuple[int, ...]:
    strides, step = [0] * len(whole), 1
    for d in range(len(whole) - 1, -1, -1):
        strides[d] = step
        step *= max(whole[d], 1)
    return tuple(strides)


def size_of(t: torch.Tensor) -> torch.Size:
    """The whole tensor's shape for a domain tensor, the shape for a plain one: what a rule reads instead of ``.shape``.

    Usage: ``n = size_of(xs)[2]  # global, in eager and compiled graphs alike``

    NOTE: inside a rule, ``x.shape`` answers globally in eager code only: Dynamo (torch 2.13) turns subclass
    dispatch off while it traces a ``__torch_function__``, so a compiled rule reading ``x.shape`` would get the
    shard's. ``redispatch`` is the same for ops (``mesh3d.domain.dispatch.dispatcher``).
    """
    return global_shape_of(t) if isinstance(t, DomainTensor) else t.shape


def detach_in_place(t: torch.Tensor) -> torch.Tensor:
    """``t.detach_()`` for a domain tensor of any layout: the tensor itself detached, not the alias of its shard that
    ``unwrap`` makes (torch will not detach a view in place).

    Usage: ``return detach_in_place(xs)`` (the rule of ``Tensor.detach_``, and the dispatcher for replicated values)
    """
    if is_wrapper(t):
        with disable_torch_function_subclass():
            torch.Tensor.detach_(t)  # autograd forgets the wrapper's history; its shard has none of its own
        return t
    with disable_torch_function_subclass():
        if view_base(t) is not None:  # NOTE: a shard aliasing the tensor it was cut from (an empty one, dim 0)
            if t.requires_grad:
                raise NotImplementedError(
                    "x.detach_() on a domain tensor whose shard is a view of the tensor it was sharded from: torch "
                    "will not detach a view in place; use x = x.detach()")
            return t  # nothing to detach
        torch.Tensor.detach_(t)
    return t


def unwrap(t: Any) -> Any:
    """The plain local tensor behind a DomainTensor (differentiable); anything else unchanged."""
    if isinstance(t, DomainTensor):
        if is_wrapper(t):
            return t._differentiable_local()  # type: ignore[attr-defined]  # a wrapper's method
        if is_dynamo_compiling():
            # NOTE: one query through ``__torch_function__`` marks the graph as handling the domain tensor's
            # dispatch itself, so torch runs it with subclass dispatch off (torch 2.13's OutputGraph). A graph
            # whose only use of a domain tensor is this unwrap would otherwise run with it on, and AOTAutograd,
            # rebuilding the returned alias, checks it against the input's global shape (Inductor raised
            # "incorrect out shape after application of ViewMeta sequence" at D > 1).
            t.dim()
            # NOTE: Dynamo cannot trace ``as_subclass`` of a subclass; an alias made with subclass dispatch
            # off is a plain tensor too (the spike in scripts/spike_subclass_compile.py).
            with disable_torch_function_subclass():
                return t.view_as(t)
        with disable_torch_function_subclass():
            return t.as_subclass(torch.Tensor)
    return t


class DomainTensor(torch.Tensor):
    """A domain-sharded tensor: global metadata, this rank's shard as its data (see the module docstring).

    Usage: ``xs = domain.shard(x, dim=2); xs.shape (global), xs.to_local(), xs.local_shape, xs.offset, xs.sizes``
    """

    #: NOTE: annotated as the slab spec, which most rules read; a grid rule reads a ``BlockSpec``'s or
    #: ``TokenSpec``'s fields after its table was chosen by ``layout`` (the declared type is ``AnySpec``).
    _spec: DomainSpec
    #: Whether this is the wrapper tensor of ``mesh3d.domain.core.wrapped`` (its shard inside, no storage of its own).
    _wraps = False
    #: ``mesh3d.domain.core.wrapped``'s differentiable maker of wrapper tensors, set when that module is imported.
    _from_local: Any = None

    # ----------------------------------------------------------------- accessors
    @property
    def spec(self) -> DomainSpec:
        return self._spec

    @property
    def sharded_dim(self) -> int | None:
        """The dim sharded over the domain, or None for a replicated value."""
        return self._spec.dim

    @property
    def sizes(self) -> tuple[int, ...] | None:
        """Every domain rank's size along the sharded dim (the split rule's output)."""
        return self._spec.sizes

    @property
    def offset(self) -> int:
        """This rank's global start index along the sharded dim."""
        return self._spec.offset

    @property
    def global_shape(self) -> torch.Size:
        """The shape of the whole (unsharded) tensor: the same as ``.shape``."""
        return global_shape_of(self)

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's shard (``to_local().shape``)."""
        return local_shape(self)

    def to_local(self) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable)."""
        return unwrap(self)

    def backward(self, gradient: torch.Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """``Tensor.backward`` on the shard (a replicated loss: its gradient is 1 on every rank).

        NOTE: called directly, not through ``__torch_function__``: the round trip cost 50 us per step, 1.5% of a
        small compiled step at D=1 (measured, docs/benchmarks.md). And straight into the autograd engine, as
        ``torch.autograd.backward`` ends, with its argument checks here: its Python part and the plain alias it
        needed cost 30 us more (``_torch_private.run_backward_from``)."""
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if inputs is not None and len(inputs) == 0:
            raise RuntimeError("backward(): inputs= cannot be empty; pass the tensors to accumulate into, or None")
        if is_wrapper(self) and ((gradient is not None and not isinstance(gradient, DomainTensor)) or inputs is not None):
            # a plain gradient for a wrapper tensor: laid out like it by the dispatcher's torch.autograd.backward (which
            # also asks for an intermediate input's gradient where its readers' gradients meet)
            return torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)
        if gradient is None:
            with disable_torch_function_subclass():
                numel = self.numel()
            if sharded_dims(self._spec):
                numel = global_shape_of(self).numel()
            if self.requires_grad and numel != 1:
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs; this domain tensor has "
                                   f"{numel} elements (shape {tuple(global_shape_of(self))}): pass gradient=")
            with disable_torch_function_subclass():
                gradient = torch.ones_like(self, memory_format=torch.preserve_format)
        run_backward_from((self,), (gradient,), create_graph if retain_graph is None else retain_graph, create_graph,
                          tuple(inputs) if inputs is not None else ())

    #: ``mesh3d.domain.layouts.slabs.full_tensor``, set when ``mesh3d.domain`` is imported (like ``_dispatcher``).
    _gather_whole: Any = None

    def full_tensor(self) -> DomainTensor:
        """The whole tensor on every domain rank, replicated (differentiable; backward keeps each rank's slice)."""
        return type(self)._gather_whole(self)

    def __deepcopy__(self, memo: dict) -> DomainTensor:
        """A copy with the same spec (torch's default deep copy of a subclass needs ``new_empty([])`` to keep the class)."""
        copied = copy.deepcopy(unwrap(self), memo)
        copied.__class__ = DomainTensor  # the copy is fresh: no caller holds it as a plain tensor
        copied._spec = self._spec
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``torch.save``/``pickle``: a replicated domain tensor as the plain tensor it equals on every rank (what one
        process would save); a sharded one refused, since it would keep this rank's shard with its layout on this
        mesh, which no other process or mesh reads as the tensor it is (``torch.load(weights_only=True)`` refused it
        with an unpickling error). ``copy.copy`` and ``copy.deepcopy`` have methods of their own."""
        if not sharded_dims(self._spec):
            return unwrap(self).__reduce_ex__(protocol)
        raise TypeError(
            f"cannot pickle a sharded domain tensor (torch.save, pickle) of shape {tuple(global_shape_of(self))}: it "
            "holds this rank's shard laid out on this mesh. Save x.full_tensor().to_local() for the whole tensor "
            "(every domain rank calls full_tensor), x.to_local() for this rank's shard, or a model's state with "
            "mesh3d.checkpoint")

    def __copy__(self) -> DomainTensor:
        """``copy.copy``: as a plain tensor's, a new leaf sharing the data (``detach()``) with ``requires_grad`` kept."""
        return self.detach().requires_grad_(self.requires_grad)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        local = unwrap(self)
        spec = self._spec
        where = f"dims={spec.dims}" if spec.layout in (Layout.BLOCKS, Layout.TOKENS) else f"dim={spec.dim}"
        return f"DomainTensor(shape={tuple(global_shape_of(self))}, {where}, sizes={self._spec.sizes}, local={local!r})"

    # ----------------------------------------------------------------- dispatch
    #: The dispatcher (``mesh3d.domain.dispatch.dispatcher.dispatch``), set when ``mesh3d.domain`` is imported.
    #: NOTE: a class attribute rather than an import, so this module (the type) does not depend on
    #: the dispatcher and its rules, which all depend on the type.
    _dispatcher: Any = None
    #: Calls answered before the dispatcher (``mesh3d.domain.dispatch.query_answers.QUERIES``): function -> handler,
    #: returning ``NotImplemented`` where the dispatcher must run. Installed with the dispatcher.
    _queries: Any = {}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # NOTE: traced, every call takes the dispatcher (torch 2.11's Dynamo cannot hash a method-wrapper key)
        if not is_dynamo_compiling():
            # NOTE: eager code never compiles a frame of its own: an op re-run where a compiled trace broke (at an op
            # on a graph tensor, say) would compile the query answers, the dispatcher and the rules as frames, once per
            # op signature, up to Dynamo's recompile limit, for nothing
            return call_without_compiling(_eager_torch_function, cls, func, types, args, kwargs)
        return cls._dispatcher(func, types, args, kwargs or {})


def _eager_torch_function(cls: type[DomainTensor], func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
    try:
        query = cls._queries.get(func)
        if query is not None:
            out = query(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return cls._dispatcher(func, types, args, kwargs or {})
    except RuntimeError as err:
        # NOTE: asked only once a rule failed: nothing on the way of every op. torch's own error about a rule's
        # Function (no setup_context, no jvp), not a refusal of mesh3d's (a NotImplementedError too) that says better
        if "autograd.Function" in str(err) and functorch_transform_active():
            raise NotImplementedError(_UNDER_TORCH_FUNC.format(op=getattr(func, "__name__", func))) from err
        raise


#: torch.func's transforms run a rule's autograd Functions only in their ``setup_context`` form, and an input passed
#: to the transform reaches the rules' floor as ATen ops (refused there by name)
_UNDER_TORCH_FUNC = ("{op} on a domain tensor under a torch.func transform: mesh3d's rules run inside grad and vjp of "
                     "a function that captures the domain tensor (reverse mode), not yet inside forward mode (jvp, "
                     "jacfwd), vmap of more than element-wise ops, or this op's. Take gradients with "
                     "torch.func.grad over a closure, torch.autograd.grad(loss, params) or loss.backward()")


# NOTE: the same for this frame, entered from eager code (traced, it is inlined as before)
never_compiled_alone(DomainTensor.__torch_function__)
