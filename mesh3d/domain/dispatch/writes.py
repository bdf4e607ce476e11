"""In-place writes into wrapper domain tensors (``mesh3d.domain.core.wrapped``), views of them included.

Usage: not called directly; the dispatcher sends an op that writes into a wrapper tensor here, and records each view
a rule makes (``record_views``)::

    h = xs * 2
    h[:, 0].add_(h[:, 2])     # a write into a view: h takes the write's history, as torch gives it
    h.transpose(1, 2).relu_()

How: the storage subclass already writes the way torch does (a rule writes into a view of the shard and autograd
rebases the shard through the view), so a write runs there: on a storage stand-in of the written tensor's shard,
made by replaying the view ops from the tensor it views (its root) on a differentiable alias of the root's shard.
Then the root and the written view take the new histories (``wrapped.rebase``). Other views of the root, now stale,
are remade from it when next read (``WrappedDomainTensor._differentiable_local``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from mesh3d._torch_private import disable_torch_function_subclass, traced_graph_input_with_history
from mesh3d.domain.core.copied_views import is_made_as_copy
from mesh3d.domain.core.relayout import relayout
from mesh3d.domain.core.settings import traced
from mesh3d.domain.core.shard_owners import version_of
from mesh3d.domain.core.tensor import DomainTensor, storage_view, unwrap
from mesh3d.domain.core.wrapped import WrappedDomainTensor, fresh_wrapper, rebase, wrapper_tensors
from mesh3d.domain.dispatch.view_semantics import VIEW_FUNCTIONS, OneProcess, one_process

__all__ = ["fresh_layout", "record_views", "written_into_wrapper"]

Run = Callable[[Callable, tuple, tuple, dict], Any]


def record_views(out: Any, func: Callable, args: tuple, kwargs: dict, answer: OneProcess | None | bool = False) -> Any:
    """``out`` (a rule's result) as torch's call on the whole tensors answers it: each wrapper view in it remembers how
    it was made from the tensor it views, ``(func, args, kwargs, index)`` (``index`` its place in a tuple result:
    ``unbind``, ``split``; else None), and takes the one-process view's strides and storage offset.

    NOTE: for the functions torch may answer with a view, which results view their input is torch's answer for the
    whole tensors (``view_semantics``), not whether this rank's shard happens to alias: an empty shard, or one of a
    single row, aliases where its peers' shards do not, and a write into a view journals its replay on every rank
    alike. A result torch makes as a copy but whose shard aliases here is given memory of its own, and every other
    function's results are such copies. ``answer``: ``view_semantics.one_process``'s, where the caller kept it."""
    if answer is False:
        answer = one_process(func, args, kwargs) if func in VIEW_FUNCTIONS else None
    views, layouts = (answer.views, answer.layouts) if answer is not None else (_NEW_MEMORY if func not in
                                                                                 VIEW_FUNCTIONS else (), ())
    if isinstance(out, WrappedDomainTensor):
        return _record(out, func, args, kwargs, None, views[0] if views else None, layouts[0] if layouts else None)
    if isinstance(out, (tuple, list)) and any(isinstance(o, WrappedDomainTensor) for o in out):
        made = [_record(o, func, args, kwargs, i, views[i] if i < len(views) else None,
                        layouts[i] if i < len(layouts) else None) if isinstance(o, WrappedDomainTensor) else o
                for i, o in enumerate(out)]
        if any(m is not o for m, o in zip(made, out)):  # NOTE: a named tuple (torch.return_types) stays one
            return type(out)(*made) if hasattr(type(out), "_fields") else type(out)(made)
    return out


#: What every function outside ``VIEW_FUNCTIONS`` answers in torch: memory of its own (F.pad on a rank it pads
#: nothing may hand back a narrowed view of its input's shard)
_NEW_MEMORY = (False,) * 64


def _record(o: WrappedDomainTensor, func: Callable, args: tuple, kwargs: dict, index: int | None,
            views: bool | None, layout: tuple | None) -> WrappedDomainTensor:
    handed_back = any(o is a for a in args)
    if handed_back and views is False and layout is not None:
        # NOTE: an input handed back where torch makes a copy (``x[:, :, 1:].contiguous()`` on a rank whose shard of
        # the slice is contiguous): a new tensor, as in one process, or a write into it would write into ``x``; the
        # shard's own copy, not the dispatcher's clone, so that ranks whose rule made a copy journal no second op
        o = fresh_wrapper(o._differentiable_local().clone(), o._spec)
        handed_back = False
    if not handed_back:
        if views is None and o._views_domain and o._local.numel() == 0:
            views = False  # NOTE: an empty shard that views its input's (F.pad's on a rank without rows) holds nothing
        if views and not is_made_as_copy(o):  # NOTE: a rule that moved rows made a copy, on every rank
            o._views_domain = True
        elif views is False and o._views_domain:
            o.own_memory()
        if layout is None and views is False:
            return fresh_layout(o, func, args, kwargs, index)
        if layout is not None and (o._strides != layout[0] or o._offset != layout[1]):
            o = relayout(o, *layout)
    if o._views_domain:
        o._replay = (func, args, kwargs, index)
    return o


def fresh_layout(o: WrappedDomainTensor, func: Callable, args: tuple, kwargs: dict | None,
                 index: int | None = None) -> WrappedDomainTensor:
    """``o``, a fresh result of ``func`` (its ``index``-th in a tuple), with the strides one process gives it (torch's
    answer on meta tensors of the whole tensors, cached per signature), where they may differ from its shard's: its
    shard leaves them open (``_ambiguous``), or it or an input is not row-major (a rule may compute in another layout
    than torch's: a halo convolution of a channels-last input, a softmax of a transpose).

    Usage: ``return fresh_layout(WrappedDomainTensor(out, spec), func, args, kwargs)``
    """
    if o._local.shape == o._whole or (not _ambiguous(o) and _row_major(o, args)):
        return o
    answer = one_process(func, args, kwargs or {})
    at = index or 0
    if answer is None or len(answer.layouts) <= at or answer.layouts[at] is None:
        return o
    strides, offset = answer.layouts[at]
    return o if (o._strides, o._offset) == (strides, offset) else relayout(o, strides, offset)


def _row_major(o: WrappedDomainTensor, args: tuple) -> bool:
    """Whether ``o`` and every domain tensor among ``args`` (and in a list or tuple there) is contiguous."""
    with disable_torch_function_subclass():  # NOTE: the wrappers' own flags, not a question through the dispatcher
        if not o.is_contiguous():
            return False
        for a in args:
            if isinstance(a, DomainTensor):
                if not a.is_contiguous():
                    return False
            elif isinstance(a, (list, tuple)) and not all(t.is_contiguous() for t in a if isinstance(t, DomainTensor)):
                return False
    return True


def _ambiguous(o: WrappedDomainTensor) -> bool:
    """Whether ``o``'s shard leaves the whole tensor's memory order open: a dim of one row or none where the whole has
    more, whose stride torch sets freely (a transposed tensor's shard of one row is contiguous; its peers' are not)."""
    shape = o._local.shape
    if 1 not in shape and 0 not in shape:  # NOTE: the common case first
        return False
    return any(n <= 1 < w for n, w in zip(shape, o._whole))


def written_into_wrapper(run: Run, func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` writing into ``args[0]``, a wrapper tensor (module docstring); ``run`` is the
    dispatcher's walk for one call."""
    target = args[0]
    _refuse_overlapping_write(func, target, args)
    chain, root = _views_up_to_root(target)
    alias = unwrap(root)
    before = version_of(alias)
    # NOTE: traced, the shard is a fake tensor, which cannot be re-classed: the stand-in is a wrapper of the alias, and
    # only a rule that answers with a new tensor is followed (the target is rebased onto it); one that writes into the
    # stand-in's shard would leave the write out of the target's history: refused there, so Dynamo breaks the graph
    # and the op runs eagerly. A write through a view is refused outright: the graph before such a break returns the
    # view, which AOTAutograd cannot rebuild for a wrapper tensor ("Node ... was invalid, but is output")
    tracing = traced()
    if tracing and chain:
        raise RuntimeError(f"{getattr(func, '__name__', func)} into a view of a domain tensor under torch.compile: not "
                           "supported yet; write out of place (y = torch.cat([...]) or torch.where), or run that code "
                           "under torch.compiler.disable")
    if tracing and _copied_shard_to_shard(func, args, kwargs):
        return target
    if tracing and torch.is_grad_enabled() and traced_graph_input_with_history(target):
        # NOTE: AOTAutograd returns a write into a graph input that has a history as an extra output, applied when the
        # graph has run, and Inductor's backward expected that output's gradient with the shard's strides and the
        # whole tensor's sizes ("expected size 2==2, stride 135==60"): the write runs eagerly (a graph break), exact
        raise NotImplementedError(f"{getattr(func, '__name__', func)} into a compiled graph's input that requires grad "
                                  "runs eagerly (a graph break)")
    with contextlib.nullcontext() if tracing else wrapper_tensors(False):
        stand_in = fresh_wrapper(alias, root._spec) if tracing else storage_view(alias, root._spec)
        for func_i, args_i, kwargs_i, index in reversed(chain):
            made = run(func_i, (), _replaced(args_i, _base_of(args_i), stand_in), kwargs_i)
            stand_in = made if index is None else made[index]
        out = run(func, types, (stand_in, *args[1:]), kwargs)
    written = out if isinstance(out, DomainTensor) and out is not stand_in else stand_in
    if tracing and written is stand_in:
        _refuse_traced_write(func)
    if chain:
        if version_of(alias) == before:
            raise NotImplementedError(
                f"{getattr(func, '__name__', func)} into a view of a domain tensor: its rule answered without writing "
                "into the view's memory, so the tensor viewed would not change as torch's does; write out of place")
        rebase(root, fresh_wrapper(alias, root._spec), check=False)
        rebase(target, _as_wrapper(written), check=False)
    else:
        rebase(target, fresh_wrapper(alias, root._spec) if written is stand_in else _as_wrapper(written))
    return target if isinstance(out, DomainTensor) else out


#: In-place by name without torch's refusal of a write into shared memory: fills (torch 2.13 warns, deprecated), and
#: those changing metadata or bookkeeping, not values (torch checks the indexed part of ``x[i] = v`` itself)
_OVERLAP_ALLOWED = frozenset({
    "fill_", "zero_", "index_fill_", "index_put_", "masked_fill_", "__setitem__", "squeeze_", "unsqueeze_", "t_",
    "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_", "resize_as_", "set_", "share_memory_",
    "requires_grad_", "detach_", "rename_"})


def _refuse_overlapping_write(func: Callable, target: WrappedDomainTensor, args: tuple) -> None:
    """torch's refusal of a write into a tensor whose elements share memory (an ``expand``: a dim of stride 0), raised
    on every rank before the rule: a rank whose shard is empty has no element to share and wrote nothing, where its
    peers raised. (Meta tensors do not check this: the ops that do not were found on CPU tensors, torch 2.13.)"""
    name = getattr(func, "__name__", "")
    if not any(stride == 0 and size > 1 for size, stride in zip(target._whole, target._strides)):
        return
    if name == "__setitem__" and len(args) > 1 and not _advanced(args[1]):  # the part written: a view of the target
        part = one_process(torch.Tensor.__getitem__, (target, args[1]), {})
        shares = part is not None and part.shapes and part.layouts and part.shapes[0] is not None and any(
            stride == 0 and size > 1 for size, stride in zip(part.shapes[0], part.layouts[0][0]))
    else:
        shares = name not in _OVERLAP_ALLOWED
    if shares:
        raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a single "
                           "memory location. Please clone() the tensor before performing the operation.")


def _advanced(index: Any) -> bool:
    """Whether an index holds tensors or lists (advanced indexing: torch writes with ``index_put_``)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, (torch.Tensor, list)) for i in items)


def _copied_shard_to_shard(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Traced, ``target.copy_(source)`` of a wrapper laid out as the target, without history to record: the source's
    shard copied into the target's, as torch's copy between the whole tensors is (True), else nothing done (False).

    NOTE: the copy AOTAutograd makes to put a compiled graph's input mutation into the graph (``apply_in_graph_mutations``:
    ``input.copy_(updated)``, with the graph's inputs as wrapper tensors) must write into the input's shard itself, the
    graph's placeholder: through the stand-in it wrote into an alias of it, which AOTAutograd refuses ("n=copy_,
    n.args[0]=detach_...")."""
    target, source = args[0], args[1] if len(args) > 1 else None
    if func not in _COPIES or len(args) != 2 or kwargs or not isinstance(source, WrappedDomainTensor):
        return False
    if source._views_domain or (torch.is_grad_enabled() and (target.requires_grad or source.requires_grad)):
        return False
    mine, theirs = target._local, source._local
    if target._spec != source._spec or mine.shape != theirs.shape or mine.dtype != theirs.dtype:
        return False
    with torch.no_grad():
        mine.copy_(theirs)
    return True


_COPIES = (torch.Tensor.copy_, torch.ops.aten.copy_.default)


def _refuse_traced_write(func: Callable) -> None:
    raise NotImplementedError(f"{getattr(func, '__name__', func)} writes into a domain tensor's shard under torch.compile, "
                              "which a trace of wrapper tensors cannot follow: it runs eagerly (a graph break)")


def _as_wrapper(t: DomainTensor) -> DomainTensor:
    return t if t._wraps else fresh_wrapper(unwrap(t), t._spec)


def _views_up_to_root(target: WrappedDomainTensor) -> tuple[list, WrappedDomainTensor]:
    """The view ops from the tensor ``target`` views (its root: a wrapper with a shard of its own) down to ``target``,
    last first, and that root."""
    chain, t = [], target
    while t._views_domain:
        replay = t._replay
        if replay is None:
            raise NotImplementedError(
                "an in-place write into a domain tensor that views another one in a way mesh3d did not record (made "
                "below the dispatcher): write out of place (x = x + ...), or into the tensor it views")
        chain.append(replay)
        t = _base_of(replay[1])
    return chain, t


def _base_of(args: tuple) -> WrappedDomainTensor:
    """The wrapper tensor among a view op's arguments whose shard the view's shard is a view of (the first one)."""
    for a in args:
        if isinstance(a, WrappedDomainTensor):
            return a
    raise AssertionError("a recorded view op has no wrapper tensor among its arguments")


def _replaced(args: tuple, base: WrappedDomainTensor, stand_in: Any) -> tuple:
    return tuple(stand_in if a is base else a for a in args)

