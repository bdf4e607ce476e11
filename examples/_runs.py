"""What the examples' runs share: whole parameters to check against one process.

Usage (on every rank: a collective for each DTensor)::

    from _runs import whole
    weights = [whole(p) for p in model.parameters()]
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["whole"]


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``, detached: for a DTensor a collective, to call on every rank.

    One mesh dim at a time, the outermost (FSDP's) first: a parameter of FSDP over tensor parallelism is split twice
    along one dim (``_StridedShard``), and ``full_tensor()`` runs the same two all-gathers but logs a warning that it
    cannot merge them; each step here is one all-gather torch plans without that message.
    """
    if not isinstance(t, DTensor):
        return t.detach()
    mesh = t.device_mesh
    for k in range(mesh.ndim):
        t = t.redistribute(mesh, [Replicate()] * (k + 1) + list(t.placements[k + 1:]))
    return t.to_local().detach()
