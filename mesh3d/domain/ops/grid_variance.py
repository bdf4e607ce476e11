"""``var`` and ``std`` of block-sharded tensors and token grids, from the layout's own ``mean`` and ``sum``.

Usage: automatic: ``torch.var(xs, dim=1, unbiased=False, keepdim=True)`` (x-unet's channel LayerNorm) on a tensor from
``domain.shard(x, dims=(2, 3))`` gives the one-process value; over the block (or token) dims it is replicated.

Two passes, as on slabs (``ops/reduce.py``): the mean over the reduced dims (kept, so it broadcasts back), then the sum
of squared deviations divided by the global count less the correction. Over dims that keep the blocks both passes are
local; over every block dim each pass is one all-reduce; over some of them the layout's ``mean`` refuses, naming it.
"""

from __future__ import annotations

import math

import torch

from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.dispatcher import redispatch
from mesh3d.domain.dispatch.registry import BLOCK_RULES, TOKEN_RULES
from mesh3d.domain.ops.reduce import reduction_rule

__all__: list[str] = []


def _grid_var(x: DomainTensor, kind: str, dim=None, keepdim: bool = False, correction: float = 1.0) -> torch.Tensor:
    dims = tuple(range(x.ndim)) if dim is None or dim == [] or dim == () else tuple(
        sorted(d % x.ndim for d in ([dim] if isinstance(dim, int) else dim)))
    count = math.prod([x.shape[d] for d in dims])  # a domain tensor's shape is global
    # NOTE: the layout's own mean (kept dims: a local one, or a replicated one after one all-reduce) and element-wise
    # rules, so the layout's checks (a reduction over only some block dims) hold here too.
    mean = redispatch(torch.mean, x, dims, True)
    deviation = redispatch(torch.sub, x, mean)
    squares = redispatch(torch.sum, redispatch(torch.mul, deviation, deviation), dims, keepdim)
    var = redispatch(torch.div, squares, max(count - correction, 0))
    return redispatch(torch.sqrt, var) if kind == "std" else var


for _table in (BLOCK_RULES, TOKEN_RULES):
    for _kind, _funcs in (("var", (torch.var, torch.Tensor.var)), ("std", (torch.std, torch.Tensor.std))):
        for _f in _funcs:
            _table.register(_f, reduction_rule(_kind, _grid_var))
