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

from mesh3d._torch_private import disable_torch_function_subclass
from mesh3d.domain.core.specs import BlockSpec, TokenSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, global_shape_of, is_wrapper, unwrap, wrap
from mesh3d.domain.core.wrapped import fresh_wrapper

__all__ = ["GRADIENT_CALLS", "autograd_backward", "autograd_grad", "domain_grad"]

GRAD_GET = torch.Tensor.grad.__get__


def domain_grad(x: DomainTensor) -> DomainTensor | None:
    """``x.grad`` laid out as ``x`` (the engine accumulated this rank's rows of it).

    Usage: ``domain_grad(xs).shape == xs.shape``
    """
    with disable_torch_function_subclass():
        g = x.grad
    if g is None or isinstance(g, DomainTensor):
        return g
    return wrap(g, x._spec)


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


def _laid_out(grads: Sequence, inputs: tuple) -> tuple:
    return tuple(wrap(g, t._spec) if isinstance(t, DomainTensor) and g is not None and not isinstance(g, DomainTensor)
                 else g for g, t in zip(grads, inputs))


def autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
                  allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """``torch.autograd.grad`` with domain tensors among ``outputs``/``inputs``: each input's gradient laid out as it.

    Usage: ``(g,) = torch.autograd.grad(u.sum(), xs, create_graph=True)  # g: a domain tensor like xs``
    """
    op = "torch.autograd.grad"
    if is_grads_batched:
        raise NotImplementedError(f"{op}(is_grads_batched=True) on domain tensors is not supported: call it once per "
                                  "batch of grad_outputs")
    outs, ins = _as_tuple(outputs), _as_tuple(inputs)
    grads = _local_grad_outputs(outs, _as_tuple(grad_outputs), op)
    with disable_torch_function_subclass():
        result = torch.autograd.grad(outs, ins, grads, retain_graph, create_graph, only_inputs, allow_unused,
                                     materialize_grads=materialize_grads)
    return _laid_out(result, ins)


def autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                      inputs=None) -> None:
    """``torch.autograd.backward`` with domain tensors: gradients of sharded outputs given per rank or globally.

    Usage: ``torch.autograd.backward([loss_a, loss_b])``
    """
    outs = _as_tuple(tensors)
    grads = _local_grad_outputs(outs, _as_tuple(grad_tensors if grad_tensors is not None else grad_variables),
                                "torch.autograd.backward")
    with disable_torch_function_subclass():
        torch.autograd.backward(outs, grads, retain_graph, create_graph, inputs=inputs)


#: Calls the dispatcher answers here before any rule table: they concern gradients of every layout alike.
GRADIENT_CALLS: dict[Callable, Callable] = {
    GRAD_GET: domain_grad,
    torch.autograd.grad: autograd_grad,
    torch.autograd.backward: autograd_backward,
}
