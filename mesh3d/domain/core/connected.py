"""Zeros that stay connected in autograd to the tensors a rank would have computed with.

Usage: ``out = connected_zeros(x, [0, c, w], weight, bias)  # a rank whose own output is empty``

Why: the backward of a halo exchange or a ring is point-to-point, so *every* rank must run it, including a rank
whose own output is empty; and parameters must get a (zero) ``.grad`` on every rank, so that summing gradients over
the domain sees the same set of tensors everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["connected_zeros"]


def connected_zeros(like: torch.Tensor, shape: Sequence[int], *inputs: torch.Tensor | None) -> torch.Tensor:
    """Zeros of ``shape`` (``like``'s dtype and device) that reach every input that requires grad in autograd.

    Usage: ``return domain.connected_zeros(ext, [n, c, 0, w], ext, weight, bias)  # this rank's empty output``
    """
    out = like.new_zeros(shape)
    for t in inputs:
        if t is not None and t.requires_grad:
            out = out + t.sum() * 0
    return out
