"""``Tensor.unfold`` (sliding windows) along the sharded dim: a window op with the halo planner's ownership; and
``movedim``, which usually follows it (the window dim moved next to the rows).

Usage: automatic: ``x.unfold(1, 3, 1)`` of a tensor sharded along dim 1 (local-attention's look-around of windows)
gives each rank the windows whose centre row it holds; the rows a window reads beyond this rank's come from their
owners (at most ``size - 1`` of them), as for a convolution of kernel ``size`` and stride ``step``.
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.step import Step
from mesh3d.domain.halo.windows import Extended, Window, plan_window

__all__: list[str] = []


@register(torch.Tensor.unfold)
def _unfold(input, dimension, size, step) -> Step:
    spec = input.spec
    d = dimension % input.ndim
    if d != spec.dim:
        return Step(lambda t: t.unfold(d, size, step), (input,), out=spec)
    plan = plan_window(spec.sizes, size, step, 1, 0, 0)
    mine = plan.out_sizes[spec.comm.index]

    def compute(ext: Extended):
        if mine == 0:  # no window here: an empty result that still reaches the shard in backward
            shape = [*ext.tensor.shape, size]
            shape[d] = 0
            return connected_zeros(ext.tensor, shape, ext.tensor)
        return ext.tensor.unfold(d, size, step)

    return Step(compute, (Window(input, plan),), out=spec.with_sizes(plan.out_sizes))


def _movedim(input, source, destination):
    """``movedim``/``moveaxis`` as the permutation it is (on slabs and strided slabs, the sharded dim moving too)."""
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    n = input.ndim
    src, dst = [s % n for s in src], [t % n for t in dst]
    order = [None] * n
    for s, t in zip(src, dst):
        order[t] = s
    rest = iter(d for d in range(n) if d not in src)
    order = [o if o is not None else next(rest) for o in order]
    spec = input.spec
    return Step(lambda t: t.permute(order), (input,), out=spec.with_sizes(spec.sizes, dim=order.index(spec.dim)))


for _f in (torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis):
    register(_f)(_movedim)
