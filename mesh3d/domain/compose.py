"""Where the domain axis meets the other two: domain tensors through tensor-parallel (model axis) modules
and beside FSDP (batch axis) parameters. This is the one module about how the axes compose.

Usage (``parallelize`` does this for every module a ``Plan.model`` style is applied to)::

    from mesh3d.domain.compose import bridge_tensor_parallel
    bridge_tensor_parallel(model.mlp.up, ColwiseParallel())   # after parallelize_module applied that style

Model axis. torch's styles turn a module's input into a DTensor on the model mesh and its output back
into a local tensor; a DomainTensor cannot be both at once. Colwise/rowwise Linear and
Embedding act on each position (token, pixel) independently, so running them on this rank's
positions is exact: the bridge hands the module the plain local shard and makes the output a
DomainTensor sharded like the input. Parameter gradients are per-shard partial sums, which the
batch axis sums over the domain like any other parameter's.

A *replicated* domain value (after a global reduction) is the same on every domain rank, so each
rank must keep 1/D of the parameter gradient (as the domain op rules do); the input's gradient is
kept whole. Modules with a ``"replicate"`` style need no bridge: their inputs stay domain tensors
(``is_plain_tensor`` is what ``ReplicateParallel`` turns into a ``Replicate`` DTensor; a domain tensor
is not), and the op rules take their ``Replicate`` DTensor parameters as local tensors: that
conversion is ``_replicated_dtensor_to_local`` in ``mesh3d/domain/dispatch/dispatcher.py``, kept beside the
dispatcher that calls it on every op.

Batch axis. FSDP/HSDP/DDP (``mesh3d/parallel/batch_parallel.py``) see only plain parameters and
gradients; the domain's contribution is that parameter gradients are SUMMED over the domain ranks
(each computed part of one sample's loss), which that module's gradient rule does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mesh3d._torch_private import own_output, wait_async_collective
from mesh3d.domain.comm.collectives import scale_grad
from mesh3d.domain.core.trees import flat_tensors, tree_map
from mesh3d.domain.core.specs import DomainSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap

__all__ = ["bridge_tensor_parallel", "is_plain_tensor"]


def is_plain_tensor(x: object) -> bool:
    """A tensor that a ``replicate`` style makes a Replicate DTensor: neither a DTensor already nor a
    domain tensor (whose ops take Replicate parameters as local tensors)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, (DTensor, DomainTensor))


def _input_spec(module: nn.Module, args: tuple, kwargs: dict) -> DomainSpec | None:
    specs = {t.spec for t in flat_tensors((args, kwargs)) if isinstance(t, DomainTensor)}
    if not specs:
        return None
    if len(specs) > 1:
        raise ValueError(
            f"{type(module).__name__} (tensor parallel): its inputs are domain tensors sharded differently "
            f"({sorted(str((sharded_dims(s), s.sizes)) for s in specs)}); pass one layout (domain.redistribute)"
        )
    spec = specs.pop()
    # A Linear mixes its input's last dim, so that dim must be whole; an Embedding only looks up
    # indices, position by position, so (B, T) tokens sharded along T are fine.
    for t in flat_tensors((args, kwargs)) if not isinstance(module, nn.Embedding) else ():
        if isinstance(t, DomainTensor) and t.ndim - 1 in sharded_dims(spec) and t.ndim > 1:
            raise NotImplementedError(
                f"{type(module).__name__} (tensor parallel) acts on the last dim, which is sharded over the "
                f"domain (dim {t.ndim - 1}); shard a spatial or sequence dim instead"
            )
    return spec


class _Bridge:
    """The pre/post forward hooks of one bridged module, and the input layout between them.

    The layout of the call in flight lives here, on the hooks' own object, not on the user's module.
    """

    def __init__(self) -> None:
        self.spec_in: DomainSpec | None = None

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        spec = _input_spec(module, args, kwargs)
        self.spec_in = spec
        if spec is None:
            return None
        size = spec.comm.size

        def to_local(o: Any) -> Any:
            if not isinstance(o, DomainTensor):
                return o
            local = unwrap(o)
            if not sharded_dims(spec) and size > 1 and local.requires_grad:
                # Undo, for the input only, the 1/D applied to the output's gradient in post_forward.
                local = scale_grad(local, float(size))
            return local

        return tree_map(to_local, args), tree_map(to_local, kwargs)

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        spec = self.spec_in
        if spec is None:
            return None
        self.spec_in = None
        size = spec.comm.size
        keep = tuple(flat_tensors((args, kwargs)))

        def to_domain(o: Any) -> Any:
            if not isinstance(o, torch.Tensor) or isinstance(o, DomainTensor):
                return o
            o = own_output(wait_async_collective(o))  # NOTE: not a view of the style's DTensor (FSDP2's hooks)
            if not sharded_dims(spec) and size > 1 and o.requires_grad:
                o = scale_grad(o, 1.0 / size)  # every domain rank computed this: each keeps 1/D of the param grads
            return adopt(o, spec, keep)

        return tree_map(to_domain, output)


def _refuse(style_name: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if any(isinstance(t, DomainTensor) and sharded_dims(t.spec) for t in flat_tensors((args, kwargs))):
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
    position_wise = isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(module, (nn.Linear, nn.Embedding))
    if position_wise:
        bridge = _Bridge()
        module.register_forward_pre_hook(bridge.pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(bridge.post_forward, with_kwargs=True)
    else:
        module.register_forward_pre_hook(_refuse(type(style).__name__), prepend=True, with_kwargs=True)
