"""Attention on a domain-sharded sequence: global SDPA (ring, gather or ulysses) and windowed attention.

Usage::

    out = F.scaled_dot_product_attention(qs, ks, vs)   # q, k, v sharded along the sequence dim (-2)

SDPA runs in the mode ``domain.attention_mode`` picks (``mesh3d.domain.attention.modes``: a ring of K/V
blocks by default on long sequences, all keys gathered on short ones); masks, windows and ``is_causal`` use
global positions. ``neighbourhood_attention`` attends within a window of +-radius tokens via a halo of
exactly ``radius`` rows from the neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d._torch_private import never_traced
from mesh3d.domain.attention.modes import attention_step, sharded_attention
from mesh3d.domain.attention.compiled import compiled_sharded_attention, takes
from mesh3d.domain.dispatch.dispatcher import run_step
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.layouts.slabs import strided_rows
from mesh3d.domain.ops.mixed_attention import mixed_attention
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.core.tensor import DomainTensor, unwrap, wrap
from mesh3d.domain.core.settings import traced

__all__ = ["neighbourhood_attention"]


def _check(q, k, v) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, DomainTensor) or t.spec.dim != t.ndim - 2:
            raise ValueError(f"scaled_dot_product_attention: the {name} must be a domain tensor sharded along its "
                             "sequence dim (-2)")
    if k.spec.sizes != v.spec.sizes:
        raise ValueError("scaled_dot_product_attention: key and value must be sharded alike")


def _kv_rows(key: DomainTensor, value: DomainTensor, needs) -> tuple[tuple, int | None]:
    """Keys and values gathered in ONE exchange when they stack (concatenated along the feature dim)."""
    k, v = unwrap(key), unwrap(value)
    if k.shape[:-1] != v.shape[:-1]:
        return (Rows(key, needs), Rows(value, needs)), None
    return (Rows(wrap(torch.cat([k, v], -1), key.spec), needs),), k.shape[-1]


def _split_kv(gathered: tuple, width: int | None):
    if width is None:
        return gathered
    both = gathered[0]
    return both[..., :width], both[..., width:]


def _batched(query, key, value) -> bool:
    """q, k and v sharded alike along a batch or head dim (windows of Swin in the batch dim): attention is local."""
    specs = [t.spec if isinstance(t, DomainTensor) else None for t in (query, key, value)]
    return all(s is not None and s.dim is not None and s.dim < t.ndim - 2 and t.ndim - s.dim == query.ndim - specs[0].dim
               and (s.sizes, s.outer) == (specs[0].sizes, specs[0].outer) for s, t in zip(specs, (query, key, value)))


def _local_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Step:
    """Attention within each batch (window) this rank holds; a mask per window is cut to this rank's windows."""
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention with dropout_p on domain tensors is not supported; use "
                                  "dropout_p=0 (or eval mode)")
    spec = query.spec
    mask = attn_mask
    if isinstance(mask, torch.Tensor) and not (isinstance(mask, DomainTensor) and mask.spec.dim is not None):
        aligned = spec.dim - (query.ndim - mask.ndim)
        if aligned >= 0 and mask.shape[aligned] != 1:
            mask = strided_rows(unwrap(mask), aligned, spec)

    def compute(q, k, v, m):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal, scale=scale,
                                             enable_gqa=enable_gqa)
        if q.numel() == 0:  # no window here: torch leaves the mask without a gradient; keep every input connected
            return connected_zeros(out, list(out.shape), q, k, v, m if isinstance(m, torch.Tensor) else None)
        return out
    return Step(compute, (query, key, value, mask), out=spec)


@register(F.scaled_dot_product_attention)
def sdpa_rule(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    mixed = mixed_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if mixed is not None:  # operands sharded differently: cross-attention, latent queries (ops/mixed_attention.py)
        return mixed
    if _batched(query, key, value):  # sharded along a batch dim (Swin's windows): local
        return _local_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if traced():
        if query.spec.comm.size == 1:  # the whole sequence is here: torch's own SDPA, traced like any op
            return _local_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if takes(query, key, value, attn_mask):  # slabs: one custom op pair carries any mode (attention_op.py)
            return compiled_sharded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        # NOTE: a mask laid out as blocks keeps the graph break: the attention runs eagerly between graphs.
        return _eager_sharded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # ring, gather or ulysses, per domain.attention_mode (mesh3d/domain/attention/modes.py)
    return attention_step(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@never_traced("mesh3d: attention over a sharded sequence runs eagerly in a compiled model")
def _eager_sharded_attention(*args):
    return sharded_attention(*args)


def neighbourhood_attention(q: DomainTensor, k: DomainTensor, v: DomainTensor, radius: int) -> DomainTensor:
    """1-D sliding-window attention: token i attends to tokens [i - radius, i + radius] (global positions).

    Usage: ``out = neighbourhood_attention(qs, ks, vs, radius=4)``
    """
    _check(q, k, v)
    n = sum(k.spec.sizes)
    needs = tuple((Span.rows(max(off - radius, 0), min(off + size + radius, n)),) if size else ()
                  for off, size in zip(offsets_of(q.spec.sizes), q.spec.sizes))
    kv, width = _kv_rows(k, v, needs)
    offset, rows_here = q.offset, q.spec.sizes[q.spec.comm.index]

    def compute(query, *gathered):
        k_ext, v_ext = _split_kv(gathered, width)
        keys = torch.arange(max(offset - radius, 0), min(offset + rows_here + radius, n), device=k_ext.device)
        rows = torch.arange(offset, offset + rows_here, device=k_ext.device)
        mask = (keys[None, :] - rows[:, None]).abs() <= radius
        return F.scaled_dot_product_attention(query, k_ext, v_ext, attn_mask=mask)

    return run_step(Step(compute, (q, *kv), out=q.spec))
