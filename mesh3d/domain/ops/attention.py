"""Attention on a domain-sharded sequence: global SDPA (keys/values gathered) and windowed attention.

Usage::

    out = F.scaled_dot_product_attention(qs, ks, vs)   # q, k, v sharded along the sequence dim (-2)

Each rank keeps its queries and gathers every key/value row (point-to-point, differentiable: the
backward sends each rank's key/value gradients to their owners, which add them). ``is_causal``
uses global positions. ``neighbourhood_attention`` attends within a window of +-radius tokens via a
halo of exactly ``radius`` rows from the neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d.domain.ops.conv import gather_window
from mesh3d.domain.registry import register
from mesh3d.domain.tensor import DomainTensor, adopt, unwrap

__all__ = ["neighbourhood_attention"]


def _check(q, k, v) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, DomainTensor) or t.spec.dim != t.ndim - 2:
            raise ValueError(f"scaled_dot_product_attention: the {name} must be a domain tensor sharded along its "
                             "sequence dim (-2)")
    if k.spec.sizes != v.spec.sizes:
        raise ValueError("scaled_dot_product_attention: key and value must be sharded alike")


@register(F.scaled_dot_product_attention)
def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _check(query, key, value)
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("scaled_dot_product_attention on domain tensors: attn_mask and dropout_p are "
                                  "not supported (use is_causal for causal masks)")
    n = sum(key.spec.sizes)
    everything = tuple(tuple(range(n)) for _ in key.spec.sizes)
    k_all, v_all = _gather_pair(key, value, everything)
    q = unwrap(query)
    mask = None
    if is_causal:
        rows = torch.arange(query.offset, query.offset + q.shape[-2], device=q.device)[:, None]
        mask = rows >= torch.arange(n, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return adopt(out, query.spec)


def neighbourhood_attention(q: DomainTensor, k: DomainTensor, v: DomainTensor, radius: int) -> DomainTensor:
    """1-D sliding-window attention: token i attends to tokens [i - radius, i + radius] (global positions)."""
    _check(q, k, v)
    n = sum(k.spec.sizes)
    lo = q.offset - radius
    hi = q.offset + q.shape[-2] + radius
    needs = []
    for off, size in zip(_offsets(q.spec.sizes), q.spec.sizes):
        needs.append(tuple(g for g in range(off - radius, off + size + radius) if 0 <= g < n) if size else ())
    k_ext, v_ext = _gather_pair(k, v, tuple(needs))
    first = max(lo, 0)
    keys = torch.arange(first, min(hi, n), device=k_ext.device)
    rows = torch.arange(q.offset, q.offset + q.shape[-2], device=k_ext.device)
    mask = (keys[None, :] - rows[:, None]).abs() <= radius
    out = F.scaled_dot_product_attention(unwrap(q), k_ext, v_ext, attn_mask=mask)
    return adopt(out, q.spec)


def _gather_pair(key: DomainTensor, value: DomainTensor, needs):
    """Gather keys and values in ONE exchange (concatenated along the feature dim, split after)."""
    k, v = unwrap(key), unwrap(value)
    if k.shape[:-1] != v.shape[:-1]:
        return gather_window(key, needs), gather_window(value, needs)
    both = gather_window(adopt(torch.cat([k, v], -1), key.spec), needs)
    return both[..., : k.shape[-1]], both[..., k.shape[-1]:]


def _offsets(sizes):
    from mesh3d.domain.split import offsets_of

    return offsets_of(sizes)
