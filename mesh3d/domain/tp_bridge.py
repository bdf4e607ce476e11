"""Domain tensors through tensor-parallel modules: the domain axis composed with the model axis.

Usage (``parallelize`` does this for every module a ``Plan.model`` style is applied to)::

    from mesh3d.domain.tp_bridge import bridge_tensor_parallel
    bridge_tensor_parallel(model.mlp.up)     # after parallelize_module put a ColwiseParallel on it

torch's styles turn a module's input into a DTensor on the model mesh and its output back
into a local tensor; a DomainTensor cannot be both at once. Colwise/rowwise Linear and
Embedding act on each position (token, pixel) independently, so running them on this rank's
positions is exact: the bridge hands the module the plain local shard and makes the output a
DomainTensor sharded like the input. Parameter gradients are per-shard partial sums, which the
batch axis sums over the domain like any other parameter's.

A *replicated* domain value (after a global reduction) is the same on every domain rank, so each
rank must keep 1/D of the parameter gradient (as the domain op rules do); the input's gradient is
kept whole. Modules with a ``"replicate"`` style need no bridge: their inputs stay domain tensors
and the op rules take their ``Replicate`` DTensor parameters as local tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mesh3d._torch_private import wait_async_collective
from mesh3d.domain.collectives import scale_grad
from mesh3d.domain.registry import flat_tensors, tree_map
from mesh3d.domain.tensor import DomainSpec, DomainTensor, adopt, unwrap

__all__ = ["bridge_tensor_parallel"]

_SPEC_ATTR = "_mesh3d_domain_spec_in"


def _input_spec(module: nn.Module, args: tuple, kwargs: dict) -> DomainSpec | None:
    specs = {t.spec for t in flat_tensors((args, kwargs)) if isinstance(t, DomainTensor)}
    if not specs:
        return None
    if len(specs) > 1:
        raise ValueError(
            f"{type(module).__name__} (tensor parallel): its inputs are domain tensors sharded differently "
            f"({sorted(str((s.dim, s.sizes)) for s in specs)}); pass one layout (domain.redistribute)"
        )
    spec = specs.pop()
    # A Linear mixes its input's last dim, so that dim must be whole; an Embedding only looks up
    # indices, position by position, so (B, T) tokens sharded along T are fine.
    for t in flat_tensors((args, kwargs)) if not isinstance(module, nn.Embedding) else ():
        if isinstance(t, DomainTensor) and spec.dim is not None and spec.dim == t.ndim - 1 and t.ndim > 1:
            raise NotImplementedError(
                f"{type(module).__name__} (tensor parallel) acts on the last dim, which is sharded over the "
                f"domain (dim {spec.dim}); shard a spatial or sequence dim instead"
            )
    return spec


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    spec = _input_spec(module, args, kwargs)
    setattr(module, _SPEC_ATTR, spec)
    if spec is None:
        return None
    size = spec.comm.size

    def to_local(o: Any) -> Any:
        if not isinstance(o, DomainTensor):
            return o
        local = unwrap(o)
        if spec.dim is None and size > 1 and local.requires_grad:
            # Undo, for the input only, the 1/D applied to the output's gradient in _post_forward.
            local = scale_grad(local, float(size))
        return local

    return tree_map(to_local, args), tree_map(to_local, kwargs)


def _post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    spec: DomainSpec | None = getattr(module, _SPEC_ATTR, None)
    if spec is None:
        return None
    setattr(module, _SPEC_ATTR, None)
    size = spec.comm.size
    keep = tuple(flat_tensors((args, kwargs)))

    def to_domain(o: Any) -> Any:
        if not isinstance(o, torch.Tensor) or isinstance(o, DomainTensor):
            return o
        o = wait_async_collective(o)
        if spec.dim is None and size > 1 and o.requires_grad:
            o = scale_grad(o, 1.0 / size)  # every domain rank computed this: each keeps 1/D of the param grads
        return adopt(o, spec, keep)

    return tree_map(to_domain, output)


def _refuse(style_name: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if any(isinstance(t, DomainTensor) and t.spec.dim is not None for t in flat_tensors((args, kwargs))):
            raise NotImplementedError(
                f"{type(module).__name__} has tensor-parallel style {style_name}, which does not take domain-sharded "
                "inputs (it would split or gather positions the domain axis already splits). Use 'colwise' or "
                "'rowwise' on Linear/Embedding, 'replicate', or call .full_tensor() before this module"
            )

    return hook


def bridge_tensor_parallel(module: nn.Module, style: object) -> None:
    """Let ``module``, given ``style`` by ``parallelize_module``, take domain tensors (see module doc).

    Position-wise styles (colwise/rowwise on Linear or Embedding) are bridged; hooks are registered
    outermost (pre-hook first, post-hook last) so torch's style hooks only ever see plain tensors.
    Any other style refuses a domain-sharded input with an error naming it. Modules never given a
    DomainTensor are unaffected.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    position_wise = isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(module, (nn.Linear, nn.Embedding))
    if position_wise:
        module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(_post_forward, with_kwargs=True)
    else:
        module.register_forward_pre_hook(_refuse(type(style).__name__), prepend=True, with_kwargs=True)
