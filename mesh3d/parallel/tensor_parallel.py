"""The model axis: tensor-parallel styles applied with ``parallelize_module`` on the model mesh.

Usage::

    apply_tp(model, {"layers.0.mlp.up": "colwise", "layers.0.mlp.down": "rowwise"}, dm.axis_mesh("model"))
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mesh3d.domain.compose import bridge_tensor_parallel, is_plain_tensor
from mesh3d.parallel.tp_dropout import mark_regions

__all__ = ["ReplicateParallel", "apply_tp", "make_style"]


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every model rank, its parameters as ``Replicate`` DTensors on the model mesh.

    Inputs arrive as plain (replicated) tensors and outputs leave as plain tensors, so the
    module composes with neighbours that are not tensor parallel. Its parameters then sit on
    the same mesh as the sharded ones (one mesh for the optimizer, clipping and checkpoints).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False) if is_plain_tensor(x) else x for x in inputs
            )

        def to_local(_module, outputs, _mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        src = self.src_data_rank

        def replicate_params(_name, sub, mesh):
            for key, param in list(sub._parameters.items()):
                if param is not None and not isinstance(param, DTensor):
                    full = distribute_tensor(param.data, mesh, (Replicate(),), src_data_rank=src)
                    sub.register_parameter(key, nn.Parameter(full, requires_grad=param.requires_grad))

        return distribute_module(
            module, device_mesh, partition_fn=replicate_params, input_fn=to_dtensor, output_fn=to_local
        )


def make_style(style: str | ParallelStyle, module: nn.Module, src_data_rank: int | None) -> ParallelStyle:
    """The ``ParallelStyle`` for a style name on ``module`` (instances pass through)."""
    if isinstance(style, ParallelStyle):
        return style
    if style == "rowwise" and isinstance(module, nn.Embedding):
        # Token ids arrive whole on every model rank; torch's default input layout for
        # rowwise is Shard(-1), which would all-gather the ids along the sequence.
        rowwise = RowwiseParallel(input_layouts=Replicate())
        rowwise.src_data_rank = src_data_rank
        return rowwise
    if style == "sequence":
        # Local outputs like colwise/rowwise, so residual adds see plain (sequence-sharded) tensors.
        sequence = SequenceParallel(use_local_output=True)
        sequence.src_data_rank = src_data_rank
        return sequence
    made: ParallelStyle = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence": SequenceParallel,
        "replicate": ReplicateParallel,
    }[style]()
    made.src_data_rank = src_data_rank
    return made


def apply_tp(model: nn.Module, styles: dict[str, str | ParallelStyle], model_mesh: DeviceMesh, *, meta: bool = False) -> None:
    """Apply ``styles`` (exact FQN → style) on the 1-D ``model_mesh``; in place, names unchanged.

    Named styles copy their shards from model-rank 0 (``src_data_rank=0``) so that ranks whose
    seeds drifted still agree; on a meta model there is nothing to copy, so no collective runs.
    """
    if not styles:
        return
    plan = {fqn: make_style(style, model.get_submodule(fqn), None if meta else 0) for fqn, style in styles.items()}
    parallelize_module(model, model_mesh, plan)
    for fqn, style in plan.items():
        if not isinstance(style, ReplicateParallel):  # replicate takes domain tensors as they are
            bridge_tensor_parallel(model.get_submodule(fqn), style)
    # NOTE: after the bridge's hooks, so a region follows the output the model's code receives (a domain tensor).
    mark_regions(model, plan, model_mesh.get_local_rank(), model_mesh.size())
