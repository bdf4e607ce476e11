"""A codebook lookup on a token grid: ``torch.cdist`` of the tokens to plain codes, ``argmin``/``argmax`` over the
codes, ``F.embedding`` of the token grid's indices. Each is token by token, so every rank computes its own tokens.

Usage: automatic, as diffusers' ``VectorQuantizer`` does on blocks::

    z = zs.permute(0, 2, 3, 1).reshape(-1, c)                 # a token grid (B*H*W, c) from blocks
    codes = torch.argmin(torch.cdist(z, codebook.weight), 1)  # this rank's tokens' nearest codes
    zq = codebook(codes).view(zs.shape)                       # back to blocks

The feature dim of ``cdist`` (summed over) and the dim ``argmin`` reduces must not be the token dim (refused, naming
it); the codes and the embedding table are plain (or replicated), whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh3d.domain.core.specs import TokenSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.registry import TOKEN_RULES, op_name
from mesh3d.domain.dispatch.step import Entering, Step

__all__: list[str] = []


def _grid(x: DomainTensor, func: Callable) -> TokenSpec:
    spec = x._spec
    assert isinstance(spec, TokenSpec)
    if spec.keys is not None:
        raise NotImplementedError(f"{op_name(func)} on attention scores of a token grid is not supported")
    return spec


def _whole(t, func: Callable):
    """A plain operand as a step's argument, or a replicated domain tensor entering every shard (``step.Entering``: its
    gradient summed over the domain, as the token grid's matmul does)."""
    if not isinstance(t, DomainTensor):
        return t
    if sharded_dims(t._spec):
        raise NotImplementedError(f"{op_name(func)} of a token grid with a tensor sharded otherwise ({t._spec}): "
                                  "gather that one first, or reshape the tokens back to the grid")
    return Entering(t)


def _cdist(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
    if not isinstance(x1, DomainTensor) or not isinstance(x1._spec, TokenSpec):
        raise NotImplementedError("torch.cdist of plain rows against a token grid: put the token grid first and "
                                  "transpose the result")
    spec = _grid(x1, torch.cdist)
    if spec.token_dim != x1.ndim - 2:
        raise NotImplementedError(f"torch.cdist of a token grid whose tokens are at dim {spec.token_dim}: they must "
                                  "be the rows (dim -2), not the feature dim summed over")
    shift = max(x1.ndim, x2.ndim) - x1.ndim
    mode = compute_mode or "use_mm_for_euclid_dist_if_necessary"  # aten.cdist's None: torch.cdist's default
    return Step(lambda a, b: torch.cdist(a, b, p, mode), (x1, _whole(x2, torch.cdist)),
                out=spec.with_token_dim(spec.token_dim + shift))


def _arg_extreme(func: Callable) -> Callable:
    def rule(input, dim=None, keepdim=False):
        spec = _grid(input, func)
        if dim is None or dim % input.ndim == spec.token_dim:
            raise NotImplementedError(f"{op_name(func)} over the token dim of a token grid (or of every element): its "
                                      "global index depends on every rank's tokens; call .full_tensor() first")
        d = dim % input.ndim
        shift = 0 if keepdim or d > spec.token_dim else 1
        return adopt(func(unwrap(input), d, keepdim), spec.with_token_dim(spec.token_dim - shift))

    return rule


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    if max_norm is not None or scale_grad_by_freq:
        raise NotImplementedError("F.embedding with max_norm or scale_grad_by_freq of a token grid's indices: both "
                                  "read every rank's indices; call .full_tensor() on the indices first")
    spec = _grid(input, F.embedding)
    return Step(lambda i, w: F.embedding(i, w, padding_idx, sparse=sparse), (input, _whole(weight, F.embedding)),
                out=spec)


TOKEN_RULES.register(torch.cdist, _cdist)
TOKEN_RULES.register(F.embedding, _embedding)
for _f in (torch.argmin, torch.Tensor.argmin, torch.argmax, torch.Tensor.argmax):
    TOKEN_RULES.register(_f, _arg_extreme(torch.argmin if "argmin" in _f.__name__ else torch.argmax))
