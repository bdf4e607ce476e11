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
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap
from mesh3d.domain.dispatch.step import Pencils, Step

__all__: list[str] = []


def _pencils(x: DomainTensor, dims: list[int], local_op: Callable[[torch.Tensor], torch.Tensor], op: str) -> Step:
    """The step of ``local_op`` with ``dims`` whole: for each grid dim among them, its rows swapped along the grid line
    with the largest dim outside the transform (``step.Pencils``), and swapped back after (``laid_out_as``). A dim
    whose length the transform changes (read from the op on a meta tensor of the whole's shape) comes back in
    ``torch.chunk`` sizes of its new length."""
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    moved = [(axis, d) for axis, d in enumerate(spec.dims) if d in dims]
    if not moved:
        return Step(lambda t: on_maybe_empty(local_op, t), (x,), out=spec)  # NOTE: FFT libraries refuse an empty block
    free = [d for d in range(x.ndim) if d not in dims and d not in spec.dims]
    if not free:
        raise NotImplementedError(f"{op} on blocks over dims {dims}: no dim outside the transform and the blocks "
                                  "is left to hold the sharding; keep the batch or channel dim out of dim=")
    shape = list(unwrap(x).shape)
    park = max(free, key=lambda d: shape[d])
    there = []
    for axis, d in moved:  # NOTE: with two grid dims the parked dim is split twice, each line splitting what is left
        line = spec.lines[axis]
        park_sizes = split_sizes(shape[park], line.size)
        there.append((line, d, tuple(spec.sizes[axis]), park, park_sizes))
        shape[d], shape[park] = sum(spec.sizes[axis]), park_sizes[line.index]
    whole = local_op(torch.empty(tuple(size_of(x)), dtype=unwrap(x).dtype, device="meta")).shape
    new_sizes = list(spec.sizes)
    back = []
    for line, d, sizes, _, park_sizes in reversed(there):
        axis = spec.dims.index(d)
        new_sizes[axis] = sizes if whole[d] == sum(sizes) else split_sizes(whole[d], line.size)
        back.append((line, park, park_sizes, d, tuple(new_sizes[axis])))
    return Step(lambda t: on_maybe_empty(local_op, t), (Pencils(x, tuple(there)),),
                out=spec.with_sizes(tuple(new_sizes)), laid_out_as=Pencils(None, tuple(back)))


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
