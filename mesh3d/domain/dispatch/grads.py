"""Input gradients by the contract: a domain tensor's ``.grad`` and ``torch.autograd.grad`` answer as the whole tensor.

Usage::

    xs = domain.shard(x, dim=2).requires_grad_()
    loss(model(xs)).backward()
    xs.grad.shape, xs.grad.norm()                       # the whole gradient's: a domain tensor laid out like xs
    (du,) = torch.autograd.grad(u.sum(), xs, create_graph=True)      # a domain tensor, differentiable again
    (d2u,) = torch.autograd.grad(du.sum(), xs)                       # second derivatives (a Laplacian)

Autograd runs on the shards (a domain tensor's data is its shard), so the engine's answers are this rank's rows;
here they are laid out as the tensor they belong to. A plain tensor among ``inputs`` (a parameter) gets its local
partial gradient, as ``.grad`` of a parameter does (summed over the domain, it is the one-process gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mesh3d._torch_private import disable_torch_function_subclass, run_backward_from, run_grad_from
from mesh3d.domain.core.specs import BlockSpec, TokenSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, global_shape_of, is_wrapper, unwrap, wrap
from mesh3d.domain.core.wrapped import fresh_wrapper, shortcut_alias

__all__ = ["GRADIENT_CALLS", "autograd_backward", "autograd_grad", "domain_grad", "register_hook", "retain_grad"]

GRAD_GET = torch.Tensor.grad.__get__


def domain_grad(x: DomainTensor) -> DomainTensor | None:
    """``x.grad`` laid out as ``x`` (the engine accumulated this rank's rows of it).

    Usage: ``domain_grad(xs).shape == xs.shape``
    """
    alias = shortcut_alias(x)
    with disable_torch_function_subclass():
        g = x.grad if alias is None else alias.grad  # NOTE: a retained gradient is kept where it meets (the alias)
    if g is None or isinstance(g, DomainTensor):
        return g
    return wrap(g, x._spec)


def register_hook(t: torch.Tensor, hook: Callable) -> Any:
    """``t.register_hook(hook)``: ``hook`` sees ``t``'s whole gradient (a wrapper tensor's, as a domain tensor laid out
    like it) and may return another.

    Usage: ``h.register_hook(lambda g: g / g.norm())``
    """
    alias = shortcut_alias(t)
    if alias is None:
        with disable_torch_function_subclass():
            return torch.Tensor.register_hook(t, hook)
    spec = t._spec  # type: ignore[attr-defined]  # a wrapper tensor's

    def on_shard(g: torch.Tensor) -> torch.Tensor | None:
        new = hook(fresh_wrapper(g, spec))
        if new is None:
            return None
        if not isinstance(new, DomainTensor):
            raise TypeError(f"a gradient hook on a domain tensor returned a {type(new).__name__}: return a domain "
                            "tensor laid out like its gradient (g / g.norm()), or None")
        return unwrap(new)

    with disable_torch_function_subclass():
        return alias.register_hook(on_shard)


def retain_grad(t: torch.Tensor) -> None:
    """``t.retain_grad()``: ``t.grad`` is then its whole gradient after backward.

    Usage: ``h.retain_grad(); loss.backward(); h.grad``
    """
    alias = shortcut_alias(t)
    with disable_torch_function_subclass():
        (t if alias is None else alias).retain_grad()


def _where_gradients_meet(inputs: tuple) -> tuple:
    """Each input as the engine must be asked for its whole gradient (a wrapper tensor read through its alias: there)."""
    return tuple(t if (a := shortcut_alias(t)) is None else a for t in inputs)


def _as_tuple(t: Any) -> tuple:
    if t is None:
        return ()
    return (t,) if isinstance(t, torch.Tensor) else tuple(t)


def _this_ranks_part(g: torch.Tensor, out: DomainTensor, op: str) -> torch.Tensor:
    """A plain gradient of ``out``'s global shape: this rank's part of it (rows, block or tokens)."""
    spec = out._spec
    whole = global_shape_of(out)
    if tuple(g.shape) != tuple(whole):
        raise ValueError(f"{op}: a plain grad_outputs of shape {tuple(g.shape)} for a domain tensor of global shape "
                         f"{tuple(whole)}: pass one of the global shape (each rank takes its part), or a domain tensor "
                         "laid out like the output (torch.ones_like(output))")
    if isinstance(spec, TokenSpec):
        return g.index_select(spec.token_dim, spec.global_index.to(g.device))
    if isinstance(spec, BlockSpec):
        for d, start, count in zip(spec.dims, spec.offsets, spec.local_sizes):
            g = g.narrow(d, start, count)
        return g
    if spec.outer > 1:
        d, rows = spec.dim, sum(spec.sizes)
        return g.unflatten(d, (spec.outer, rows)).narrow(d + 1, spec.offset, spec.sizes[spec.comm.index]).flatten(d, d + 1)
    return g.narrow(spec.dim, spec.offset, spec.sizes[spec.comm.index])


def _local_grad_outputs(outputs: tuple, grad_outputs: tuple, op: str) -> tuple:
    """Each output's gradient as a plain local tensor (None: the implicit 1 of a scalar, checked globally)."""
    if grad_outputs and len(grad_outputs) != len(outputs):
        raise ValueError(f"{op}: got {len(grad_outputs)} grad_outputs for {len(outputs)} outputs")
    out = []
    for o, g in zip(outputs, grad_outputs or (None,) * len(outputs)):
        sharded = isinstance(o, DomainTensor) and bool(sharded_dims(o._spec))
        if g is None:
            numel = math.prod(global_shape_of(o)) if isinstance(o, DomainTensor) else o.numel()
            if o.requires_grad and numel != 1:
                raise RuntimeError(f"{op}: grad can be implicitly created only for scalar outputs; this output has "
                                   f"{numel} elements (global shape {tuple(global_shape_of(o))}): pass grad_outputs")
            out.append(None)
        elif isinstance(g, DomainTensor):
            if sharded and g._spec != o._spec:
                raise ValueError(f"{op}: grad_outputs laid out otherwise than its output (specs {g._spec} and "
                                 f"{o._spec}); use torch.ones_like(output) or domain.redistribute it first")
            out.append(_for_output(unwrap(g), o))
        else:
            out.append(_for_output(_this_ranks_part(g, o, op) if sharded else g, o))
    return tuple(out)


def _for_output(local: torch.Tensor, output: Any) -> torch.Tensor:
    """A gradient's shard as the engine takes it for ``output``: the shard for a storage domain tensor (autograd runs on
    shards), a wrapper tensor laid out like a wrapper output (autograd runs on wrappers)."""
    return fresh_wrapper(local, output._spec) if is_wrapper(output) else local


def _engine_grads(outputs: tuple, grads: tuple) -> tuple:
    """Each output's gradient as the engine takes it, the implicit 1 of a scalar output made here."""
    made = []
    for o, g in zip(outputs, grads):
        if g is None:
            with disable_torch_function_subclass():  # NOTE: a wrapper's ones are made by the floor, a shard's as torch
                g = torch.ones_like(o, memory_format=torch.preserve_format)
        made.append(g)
    return tuple(made)


def _laid_out(grads: Sequence, inputs: tuple) -> tuple:
    return tuple(wrap(g, t._spec) if isinstance(t, DomainTensor) and g is not None and not isinstance(g, DomainTensor)
                 else g for g, t in zip(grads, inputs))


def autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
                  allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """``torch.autograd.grad`` with domain tensors among ``outputs``/``inputs``: each input's gradient laid out as it.

    Usage: ``(g,) = torch.autograd.grad(u.sum(), xs, create_graph=True)  # g: a domain tensor like xs``
    """
    op = "torch.autograd.grad"
    del only_inputs  # NOTE: deprecated; torch ignores it too
    if is_grads_batched:
        raise NotImplementedError(f"{op}(is_grads_batched=True) on domain tensors is not supported: call it once per "
                                  "batch of grad_outputs")
    outs, ins = _as_tuple(outputs), _as_tuple(inputs)
    if not ins:
        raise RuntimeError(f"{op} requires non-empty inputs")
    if allow_unused is None:
        allow_unused = materialize_grads
    if materialize_grads and not allow_unused:
        raise ValueError(f"{op}: materialize_grads=True needs allow_unused=True (or None)")
    grads = _engine_grads(outs, _local_grad_outputs(outs, _as_tuple(grad_outputs), op))
    # NOTE: straight into the engine (only_inputs is deprecated and ignored, as by torch): hooks and backward
    # functions then run with domain tensors' rules on, as under loss.backward()
    result = run_grad_from(outs, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                           _where_gradients_meet(ins), allow_unused)
    if materialize_grads:
        result = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(result, ins))
    return _laid_out(result, ins)


def autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                      inputs=None) -> None:
    """``torch.autograd.backward`` with domain tensors: gradients of sharded outputs given per rank or globally.

    Usage: ``torch.autograd.backward([loss_a, loss_b])``
    """
    op = "torch.autograd.backward"
    outs = _as_tuple(tensors)
    grads = _engine_grads(outs, _local_grad_outputs(outs, _as_tuple(grad_tensors if grad_tensors is not None
                                                                     else grad_variables), op))
    if inputs is not None:
        inputs = _where_gradients_meet(_as_tuple(inputs))
        if not inputs:
            raise RuntimeError(f"{op}: inputs= cannot be empty; pass the tensors to accumulate into, or None")
    run_backward_from(outs, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                      inputs if inputs is not None else ())


#: Calls the dispatcher answers here before any rule table: they concern gradients of every layout alike.
GRADIENT_CALLS: dict[Callable, Callable] = {
    GRAD_GET: domain_grad,
    torch.autograd.grad: autograd_grad,
    torch.autograd.backward: autograd_backward,
    torch.Tensor.register_hook: register_hook,
    torch.Tensor.retain_grad: retain_grad,
}
