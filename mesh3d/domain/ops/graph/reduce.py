"""Reductions of graph tensors: ``sum`` / ``mean`` / ``prod`` / ``amax`` over the items (replicated, the one-process value) or over other dims
(local), and the MSE / L1 losses.

Usage (through torch): ``loss = F.mse_loss(pred_nodes, target_nodes)``, ``pooled = h.mean(0)``, ``h.sum(-1)``
"""

from __future__ import annotations


from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.registry import GRAPH_RULES
from mesh3d.domain.ops.blocks.rules import local_reduction, reduction_rules
from mesh3d.domain.dispatch.step import Step
from mesh3d.domain.ops.reduce import total_step
from mesh3d.domain.ops.graph.common import graph_spec_of

__all__ = ["reduce_graph"]


def reduce_graph(x: DomainTensor, kind: str, dim=None, keepdim: bool = False) -> DomainTensor | Step:
    """``x.sum`` / ``x.mean`` / ``x.prod`` / ``x.amax`` over ``dim`` (all when None): over the items, a replicated total; else local.

    Usage: ``reduce_graph(h, "mean", 0)``
    """
    spec, local = graph_spec_of(x), unwrap(x)
    dims = list(range(x.ndim)) if dim is None or dim == [] or dim == () else sorted(
        d % x.ndim for d in ([dim] if isinstance(dim, int) else dim))
    if spec.dim not in dims:  # every rank reduces its own items' features
        shift = 0 if keepdim else sum(d < spec.dim for d in dims)
        return adopt(local_reduction(local, kind, dims, keepdim, dim is None),
                     spec.replaced(dim=spec.dim - shift, endpoint=None))
    return total_step(x, kind, dim, dims, keepdim, spec.comm, full_kernel=False)  # the parts combined by the executor


for _f, _rule in reduction_rules(reduce_graph, "a graph layout").items():
    GRAPH_RULES.register(_f, _rule)
