"""How much a model downsamples the sharded dim: a dry run on meta tensors, no memory, no communication.

Usage::

    m = domain.downsampling_factor(model, x.shape, dim=2)     # e.g. 16 for a U-Net with four 2x poolings
    xs = domain.shard(x, dim=2, multiple_of=m)                 # every rank's size but the last: a multiple of m

Sizes are global, so any split gives the one-process answer; a split whose sizes (but the last) are
multiples of the product of the strides that downsample the dim keeps every shard a whole number of
windows all the way down, so pooling leaves no rank with a sliver of the work.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.halo.windows import WindowProbe
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import wrap

__all__ = ["downsampling_factor"]


def downsampling_factor(model: nn.Module, input_shape: Sequence[int], dim: int,
                        dtype: torch.dtype | None = None) -> int:
    """The largest factor by which ``model`` shrinks ``dim`` of an input of ``input_shape`` (1: it never does).

    Usage: ``m = domain.downsampling_factor(unet, (1, 3, 64, 64), dim=2)  # 16``

    The model runs once on the meta device (its parameters are swapped for meta tensors of the same
    shapes; nothing is allocated or computed) as one domain rank, and every window op (conv, pooling)
    along ``dim`` reports its input and output lengths: the factor is the largest ratio of the input
    length to a window op's output length, rounded (so odd lengths floored by pooling still count).
    """
    shape = tuple(int(s) for s in input_shape)
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim={dim} is out of range for an input of shape {shape}")
    dim %= len(shape)
    meta = {name: torch.empty_like(t, device="meta")
            for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    if dtype is None:  # the model's own floating dtype
        dtype = next((t.dtype for t in meta.values() if t.is_floating_point()), torch.get_default_dtype())
    one_rank = DomainComm(None, (0,), 0)
    x = wrap(torch.empty(shape, dtype=dtype, device="meta"), DomainSpec(dim, (shape[dim],), one_rank))
    with WindowProbe() as probe, torch.no_grad():
        functional_call(model, meta, (x,))
    ratios = [round(shape[dim] / out) for _, out in probe.lengths if 0 < out < shape[dim]]
    return max(ratios, default=1)
