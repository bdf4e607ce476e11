"""Array functions that libraries choosing a backend by a tensor's module find under ``mesh3d``.

Usage: nothing to call. opt_einsum (and tensorly, which neuraloperator's spectral convolutions contract
through) picks its backend from ``type(x).__module__``: ``"mesh3d"`` for a domain tensor. It then looks for
``mesh3d.tensordot``, ``mesh3d.transpose`` and ``mesh3d.einsum``; without them it falls back to NumPy, which
cannot take a tensor that requires grad. These forward to torch, whose rules run on the domain tensor.
"""

from __future__ import annotations

import torch

__all__ = ["einsum", "tensordot", "transpose"]


def tensordot(a: torch.Tensor, b: torch.Tensor, axes=2) -> torch.Tensor:
    """numpy.tensordot's signature, computed by torch.tensordot."""
    return torch.tensordot(a, b, dims=axes)


def transpose(a: torch.Tensor, axes=None) -> torch.Tensor:
    """numpy.transpose's signature: a permutation of the dims (reversed when ``axes`` is None)."""
    return a.permute(*(reversed(range(a.ndim)) if axes is None else axes))


def einsum(equation: str, *operands: torch.Tensor, **kwargs) -> torch.Tensor:
    """torch.einsum (keyword arguments such as opt_einsum's ``optimize`` are not torch's: dropped)."""
    return torch.einsum(equation, *operands)
