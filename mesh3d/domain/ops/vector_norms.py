"""Vector norms of domain tensors (``x.norm()``, ``torch.linalg.vector_norm``) on slabs, blocks and token grids.

Usage: automatic: ``xs.grad.norm()``, ``torch.linalg.vector_norm(ys, ord=1, dim=(2, 3))`` give the one-process value
(replicated when the reduced dims include the sharded ones).

A p-norm is a sum (of ``|x|^p``) and a root, so it runs as the layout's own ``sum`` (one all-reduce of the partial
sums over the sharded dims; local over the others), then the root; the inf-norms are ``amax``/``amin`` of ``|x|``.
"""

from __future__ import annotations

import math

import torch

from mesh3d.domain.dispatch.dispatcher import redispatch
from mesh3d.domain.dispatch.registry import BLOCK_RULES, RULES, TOKEN_RULES, op_name

__all__ = ["vector_norm"]


def vector_norm(x: torch.Tensor, ord: float = 2, dim=None, keepdim: bool = False, dtype=None) -> torch.Tensor:
    """``torch.linalg.vector_norm(x, ord, dim, keepdim)`` of a domain tensor, from its layout's reductions.

    Usage: ``vector_norm(xs, 2)``
    """
    if dtype is not None:
        x = redispatch(torch.Tensor.to, x, dtype)
    a = redispatch(torch.abs, x)
    if ord == math.inf:
        return redispatch(torch.amax, a, dim, keepdim)
    if ord == -math.inf:
        return redispatch(torch.neg, redispatch(torch.amax, redispatch(torch.neg, a), dim, keepdim))
    if ord == 0:
        return redispatch(torch.sum, redispatch(torch.Tensor.to, redispatch(torch.ne, a, 0), a.dtype), dim, keepdim)
    if ord == 1:
        return redispatch(torch.sum, a, dim, keepdim)
    if ord == 2:
        return redispatch(torch.sqrt, redispatch(torch.sum, redispatch(torch.mul, a, a), dim, keepdim))
    return redispatch(torch.pow, redispatch(torch.sum, redispatch(torch.pow, a, ord), dim, keepdim), 1.0 / ord)


def _tensor_norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """``torch.norm`` / ``Tensor.norm``: the vector p-norms ("fro" over all dims or a list of dims is the 2-norm)."""
    if out is not None:
        raise NotImplementedError(f"{op_name(torch.norm)}(out=...) on a domain tensor is not supported: use the result")
    if p == "nuc" or (isinstance(p, str) and p != "fro"):
        raise NotImplementedError(f"{op_name(torch.norm)}(p={p!r}) on a domain tensor is not supported: a matrix norm "
                                  "mixes the sharded rows; call .full_tensor() first, or use a vector p-norm")
    return vector_norm(input, 2 if p == "fro" or p is None else p, dim, keepdim, dtype)


def _linalg_norm(input, ord=None, dim=None, keepdim=False, *, out=None, dtype=None):
    """``torch.linalg.norm``: a vector norm (``ord`` a number, or None) over one dim or all."""
    if out is not None:
        raise NotImplementedError("torch.linalg.norm(out=...) on a domain tensor is not supported")
    matrix = isinstance(ord, str) or (isinstance(dim, (tuple, list)) and len(dim) == 2 and ord is not None)
    if matrix:
        raise NotImplementedError(f"torch.linalg.norm(ord={ord!r}, dim={dim!r}) on a domain tensor: a matrix norm is "
                                  "not supported; use torch.linalg.vector_norm, or call .full_tensor() first")
    return vector_norm(input, 2 if ord is None else ord, dim, keepdim, dtype)


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    if out is not None:
        raise NotImplementedError("torch.linalg.vector_norm(out=...) on a domain tensor is not supported")
    return vector_norm(x, ord, dim, keepdim, dtype)


for _table in (RULES, BLOCK_RULES, TOKEN_RULES):
    for _f in (torch.norm, torch.Tensor.norm):
        _table.register(_f, _tensor_norm)
    _table.register(torch.linalg.norm, _linalg_norm)
    _table.register(torch.linalg.vector_norm, _vector_norm)


def _normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``F.normalize``: divided by the p-norm along ``dim`` (local when ``dim`` is not sharded, global when it is)."""
    if out is not None:
        raise NotImplementedError("F.normalize(out=...) on a domain tensor is not supported")
    norm = vector_norm(input, p, dim % input.ndim, True)
    return redispatch(torch.div, input, redispatch(torch.clamp_min, norm, eps))


for _table in (RULES, BLOCK_RULES, TOKEN_RULES):
    _table.register(torch.nn.functional.normalize, _normalize)
