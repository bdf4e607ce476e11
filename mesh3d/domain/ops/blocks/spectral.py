"""``torch.fft.*`` on block-sharded tensors: a pencil decomposition.

Usage: automatic; ``torch.fft.rfftn(xs, dim=(-2, -1))`` with ``xs = domain.shard(x, dims=(2, 3))`` on a 2x2
domain grid gives the one-process spectrum, block-sharded the same way (``torch.chunk`` sizes of a dim
whose length the transform changes).

The transformed dims must be whole on a rank. For each grid dim whose tensor dim is transformed, the
ranks of that grid line swap rows (an all-to-all, ``transpose.move_rows``) so that the dim becomes
whole and the largest dim outside the transform is split among them instead; with two grid dims
that dim is split twice (nested: each grid line splits what the previous one left). The transform
then runs locally, and the same swaps in reverse order put the blocks back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.ops.spectral import FFT_OPS, transformed_dims, global_sizes, on_maybe_empty, with_fft_signature
from mesh3d.domain.dispatch.registry import BLOCK_RULES
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.layouts.transpose import move_rows

__all__: list[str] = []


def _pencils(x: DomainTensor, dims: list[int], local_op: Callable[[torch.Tensor], torch.Tensor], op: str):
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    moved = [(axis, d) for axis, d in enumerate(spec.dims) if d in dims]
    local = unwrap(x)
    if not moved:
        return adopt(on_maybe_empty(local_op, local), spec)  # NOTE: FFT libraries refuse an empty block
    free = [d for d in range(x.ndim) if d not in dims and d not in spec.dims]
    if not free:
        raise NotImplementedError(f"{op} on blocks over dims {dims}: no dim outside the transform and the blocks "
                                  "is left to hold the sharding; keep the batch or channel dim out of dim=")
    park = max(free, key=lambda d: local.shape[d])
    parked = []  # (axis, the sizes of the parked dim on its grid line)
    for axis, d in moved:
        line = spec.lines[axis]
        park_sizes = split_sizes(local.shape[park], line.size)
        local = move_rows(local, line, d, spec.sizes[axis], park, park_sizes)
        parked.append((axis, park_sizes))
    out = on_maybe_empty(local_op, local)
    new_sizes = list(spec.sizes)
    for axis, park_sizes in reversed(parked):
        d, line = spec.dims[axis], spec.lines[axis]
        n_out = out.shape[d]
        new_sizes[axis] = spec.sizes[axis] if n_out == sum(spec.sizes[axis]) else split_sizes(n_out, line.size)
        out = move_rows(out, line, park, park_sizes, d, new_sizes[axis])
    return adopt(out, spec.with_sizes(tuple(new_sizes)))


def _fft_rule(name: str, kind: int) -> Callable:
    func = getattr(torch.fft, name)

    def run(x, size, dim, norm):
        size = global_sizes(size)
        return _pencils(x, transformed_dims(kind, x.ndim, dim, size), lambda t: func(t, size, dim, norm),
                        f"torch.fft.{name}")

    return with_fft_signature(kind, run)


def _shift_rule(name: str) -> Callable:
    func = getattr(torch.fft, name)

    def rule(input, dim=None):
        dims = list(range(input.ndim)) if dim is None else [d % input.ndim for d in ([dim] if isinstance(dim, int)
                                                                                     else dim)]
        return _pencils(input, dims, lambda t: func(t, dim), f"torch.fft.{name}")

    return rule


for _name, _kind in FFT_OPS.items():
    BLOCK_RULES.register(getattr(torch.fft, _name), _fft_rule(_name, _kind))
for _name in ("fftshift", "ifftshift"):
    BLOCK_RULES.register(getattr(torch.fft, _name), _shift_rule(_name))
