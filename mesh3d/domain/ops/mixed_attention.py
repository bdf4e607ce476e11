"""Attention whose operands are not sharded alike: cross-attention to a plain conditioning, latent queries over
sharded keys, and either over a batch-like sharded dim.

Usage: automatic, through ``F.scaled_dot_product_attention``::

    out = F.scaled_dot_product_attention(q_s, k_text, v_text)   # queries sharded (pixels), keys plain (text tokens)
    lat = F.scaled_dot_product_attention(latents, k_s, v_s)     # plain latent queries over sharded keys: replicated
    y = F.scaled_dot_product_attention(q, k_b, v_b)             # keys sharded along a batch-like dim, q plain

Each operand is *sharded along the sequence* (dim -2, a slab or a token grid), *sharded along a batch-like dim*
(a dim before -2: windows, pixels merged into the batch), or *whole* (plain, or replicated over the domain):

* queries along the sequence, keys and values whole: each rank's queries attend to every key (local; a mask's rows
  and ``is_causal`` read by the queries' global indices);
* queries whole, keys and values along the sequence: each rank attends to its keys, and the partial results merge by
  their log-sum-exp over the domain (one max and one sum): the result is replicated, every rank holding it whole.
  O(Lq x S/D) per rank, never the whole key sequence;
* batch-like dims: the whole operands' rows of that dim are this rank's ones (or size 1, broadcast): local.

Whole operands that are plain tensors (parameters: learned latents) get this rank's partial gradient, summed over the
domain as every parameter's; replicated ones get it summed for them. Other mixes raise naming the operands.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mesh3d.domain.core.specs import DomainSpec, TokenSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, size_of, unwrap
from mesh3d.domain.dispatch.step import Combining, Entering, Step
from mesh3d.domain.ops.idioms import replicated_slice

__all__ = ["mixed_attention"]

_SEQ, _BATCH, _WHOLE = "sequence", "batch", "whole"


def _kind(t) -> str:
    if not isinstance(t, DomainTensor) or not sharded_dims(t._spec):
        return _WHOLE
    spec = t._spec
    if isinstance(spec, TokenSpec):
        return _SEQ if spec.token_dim == t.ndim - 2 and spec.keys is None else "other"
    if spec.layout.value not in ("slab", "strided"):
        return "other"
    if spec.dim == t.ndim - 2 and spec.outer == 1:
        return _SEQ
    return _BATCH if spec.dim < t.ndim - 2 else "other"


def _whole(t):
    """A whole operand as the local computation takes it (a replicated one's gradient summed over the domain)."""
    return Entering(t) if isinstance(t, DomainTensor) else t


def _query_positions(q: DomainTensor) -> torch.Tensor:
    """Global (sequence) indices of this rank's query rows."""
    spec = q._spec
    if isinstance(spec, TokenSpec):
        return spec.global_index
    return torch.arange(spec.offset, spec.offset + spec.sizes[spec.comm.index])


def mixed_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA of operands sharded differently (module docstring), or None when q, k and v are laid out alike.

    Usage: ``done = mixed_attention(q, k, v); if done is not None: return done`` (first in the SDPA rules)
    """
    kinds = tuple(_kind(t) for t in (query, key, value))
    if kinds in ((_SEQ,) * 3, (_BATCH,) * 3) or kinds == (_WHOLE,) * 3:
        return None
    names = ", ".join(f"{n} {k}" for n, k in zip(("query", "key", "value"), kinds))
    if kinds[1] != kinds[2] or "other" in kinds:
        raise ValueError(
            f"scaled_dot_product_attention: the key and value must be laid out alike, each sharded along the sequence "
            f"(dim -2), along one batch-like dim, or whole (plain or replicated); got {names}. Shard them alike (or "
            "keep both plain)")
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention with dropout_p on domain tensors is not supported: each "
                                  "rank would draw its own mask; use dropout_p=0 (or eval mode)")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal, not both (as torch's SDPA)")
    q_kind, kv_kind = kinds[0], kinds[1]
    if q_kind == _SEQ and kv_kind == _WHOLE:
        return _queries_sharded(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if q_kind == _WHOLE and kv_kind == _SEQ:
        return _keys_sharded(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if {q_kind, kv_kind} == {_BATCH, _WHOLE}:
        return _batch_sharded(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    raise ValueError(
        f"scaled_dot_product_attention: {names}: queries sharded along the sequence need keys and values sharded "
        "along it too (or whole), and an operand sharded along a batch-like dim needs the others sharded along it "
        "too (or whole); lay them out alike")


def _queries_sharded(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> Step:
    positions = _query_positions(query)  # the queries' global indices
    mask = attn_mask
    if isinstance(mask, DomainTensor) and sharded_dims(mask._spec):
        if mask._spec != query._spec:
            raise ValueError("scaled_dot_product_attention: a sharded attn_mask must be laid out like the queries")
    else:
        mask = _whole(mask)
    own_rows = isinstance(attn_mask, DomainTensor) and sharded_dims(attn_mask._spec)

    def compute(q, k, v, m):
        if m is not None and not own_rows and m.ndim >= 2 and m.shape[-2] != 1:  # a whole mask: this rank's rows
            m = m.index_select(m.ndim - 2, positions.to(m.device))
        if is_causal:  # top-left aligned, as torch's SDPA: query i sees keys j <= i (global i)
            m = torch.arange(k.shape[-2], device=q.device)[None, :] <= positions.to(q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=enable_gqa)

    return Step(compute, (query, _whole(key), _whole(value), mask), out=query._spec)


def _keys_sharded(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> Step:
    spec = key._spec
    comm = spec.comm
    if isinstance(value, DomainTensor) and value._spec != spec:
        raise ValueError("scaled_dot_product_attention: key and value must be sharded alike along the sequence")
    cols = _query_positions(key)  # the keys' global indices
    if isinstance(attn_mask, DomainTensor) and sharded_dims(attn_mask._spec):
        raise ValueError("scaled_dot_product_attention: with whole queries over sharded keys, pass a plain or "
                         "replicated (..., L_q, S_k) attn_mask")
    q, mask = _whole(query), _whole(attn_mask)
    q_shape, k_shape = tuple(size_of(query)), tuple(unwrap(key).shape)
    if len(q_shape) == 4 and len(k_shape) == 4 and k_shape[1] != q_shape[1] and not enable_gqa:
        raise ValueError(f"scaled_dot_product_attention: {q_shape[-3]} query heads and {k_shape[-3]} key heads: "
                         "pass enable_gqa=True (query heads a multiple of key heads)")

    def compute(q, k, v, mask, combine):
        if mask is not None and mask.shape[-1] != 1:
            mask = mask.index_select(mask.ndim - 1, cols.to(mask.device))
        if q.ndim == 4 and k.ndim == 4 and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], -3) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        if is_causal:
            mask = cols.to(q.device)[None, :] <= torch.arange(q.shape[-2], device=q.device)[:, None]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        # NOTE: the global max only shifts the exponent (it cancels): no gradient through it
        top = combine(scores.detach().amax(-1, keepdim=True) if scores.shape[-1] else
                      scores.new_full((*scores.shape[:-1], 1), float("-inf")), "max")
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(scores - top)
        total = combine(weights.sum(-1, keepdim=True))
        out = combine(weights @ v)
        return torch.where(total > 0, out / torch.where(total > 0, total, torch.ones_like(total)),
                           torch.zeros_like(out))

    return Step(compute, (q, key, value, mask, Combining(comm)), out=DomainSpec.replicated(comm))


def _batch_sharded(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> Step:
    ref = next(t for t in (query, key, value) if isinstance(t, DomainTensor) and sharded_dims(t._spec))
    spec = ref._spec
    d = spec.dim - ref.ndim  # from the end: the same dim of every operand

    def rows(t):
        if t is None or (isinstance(t, DomainTensor) and sharded_dims(t._spec)):
            return t
        at = t.ndim + d
        if at < 0 or size_of(t)[at] == 1:
            return _whole(t)
        if size_of(t)[at] != sum(spec.sizes) * spec.outer:
            raise ValueError(f"scaled_dot_product_attention: an operand of shape {tuple(size_of(t))} next to one "
                             f"sharded along its dim {spec.dim} (global length {sum(spec.sizes) * spec.outer}): give "
                             "it that length there (each rank takes its rows) or 1")
        return replicated_slice(t, at, ref)

    def compute(q, k, v, m):
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)

    out_spec = spec if query is ref or query.ndim == ref.ndim else spec.with_sizes(spec.sizes, dim=query.ndim + d)
    return Step(compute, (rows(query), rows(key), rows(value), rows(attn_mask)), out=out_spec,
                keep=tuple(t for t in (query, key, value, attn_mask) if isinstance(t, torch.Tensor)
                           and not isinstance(t, DomainTensor)))
