"""``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``/``DecoderLayer``) on
tokens sharded along the sequence, as a composite of ruled ops.

Usage: automatic: ``nn.TransformerEncoderLayer(d, h, batch_first=True)(xs)`` on ``xs = domain.shard(x, dim=1)``, or
``mha(xs, xs, xs, need_weights=False)``, gives the one-process result, sharded like ``xs``.

The formula torch computes, each step through the dispatcher: the input projections (per token, local), heads split
to ``(N, H, L, E/H)`` (the sequence stays the sharded dim), ``F.scaled_dot_product_attention`` over the domain (ring,
gather or Ulysses, as ``domain.attention_mode`` says; masks by global index), the heads merged and the output
projection. ``attn_mask`` and ``key_padding_mask`` are plain tensors of the global lengths, or domain tensors (a
padding mask sharded like the tokens), made whole first; combined as torch combines them (a boolean True, or -inf,
masks a key). What needs the whole score matrix on one rank or has no such formula is
refused by name before anything runs: the attention weights (``need_weights=True``, ``nn.MultiheadAttention``'s
default: pass ``need_weights=False``), ``bias_k``/``bias_v``, ``add_zero_attn``, ``static_k``/``static_v``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.ops.composite import call, register_composite

__all__: list[str] = []

_NAME = "F.multi_head_attention_forward (nn.MultiheadAttention)"


def _refuse_unsupported(need_weights: bool, bias_k: Any, bias_v: Any, add_zero_attn: bool, static_k: Any,
                        static_v: Any) -> None:
    if need_weights:
        raise NotImplementedError(
            f"{_NAME} with need_weights=True on a domain tensor: the attention weights would need every query's "
            "scores against every key on one rank. Call it with need_weights=False (nn.TransformerEncoderLayer "
            "and DecoderLayer do), and compute weights, if you need them, from .full_tensor() of the inputs")
    if add_zero_attn or any(t is not None for t in (bias_k, bias_v, static_k, static_v)):
        raise NotImplementedError(f"{_NAME} with bias_k/bias_v, add_zero_attn or static_k/static_v on a domain "
                                  "tensor is not supported: build the attention without them")


def _whole(mask: Any) -> Any:
    """A mask laid out on the domain (a padding mask sharded like the tokens) as the plain global mask: every rank's
    queries read every key. NOTE: a collective, reached on every rank alike (whether a mask is a domain tensor is the
    same everywhere); a mask is (N, S) or (L, S), small beside the activations."""
    return mask.full_tensor().to_local() if isinstance(mask, DomainTensor) else mask


def _as_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """torch's reading of an attention mask: a boolean True masks (-inf), a float mask is added."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))  # on the mask's device
    return mask.to(dtype)


def _combined_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int, heads: int,
                   tgt: int, src: int, dtype: torch.dtype) -> torch.Tensor | None:
    """One additive mask broadcastable to ``(N, H, L, S)``, or None."""
    attn, padding = _as_additive(attn_mask, dtype), _as_additive(key_padding_mask, dtype)
    if attn is not None:
        attn = attn.view(1, 1, tgt, src) if attn.dim() == 2 else attn.view(batch, heads, tgt, src)
    if padding is not None:
        padding = padding.view(batch, 1, 1, src)
    if attn is None or padding is None:
        return attn if padding is None else padding
    return attn + padding


def _projections(query, key, value, in_proj_weight, in_proj_bias, separate: bool, weights: tuple) -> tuple:
    if separate:
        w_q, w_k, w_v = weights
    else:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    b_q, b_k, b_v = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
    return (call(F.linear, query, w_q, b_q), call(F.linear, key, w_k, b_k), call(F.linear, value, w_v, b_v))


def _heads(t, length: int, batch: int, heads: int, head_dim: int):
    """``(L, N, E)`` -> ``(N, H, L, E/H)``."""
    return call(torch.permute, call(torch.reshape, t, (length, batch, heads, head_dim)), (1, 2, 0, 3))


@register_composite(F.multi_head_attention_forward)
def _multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                  bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                  training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                  use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                  v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                  is_causal=False):
    del average_attn_weights  # NOTE: it shapes only the attention weights, which are refused
    _refuse_unsupported(need_weights, bias_k, bias_v, add_zero_attn, static_k, static_v)
    attn_mask, key_padding_mask = _whole(attn_mask), _whole(key_padding_mask)
    unbatched = query.dim() == 2
    if unbatched:  # (L, E): one sequence, as torch does it
        query, key, value = (call(torch.unsqueeze, t, 1) for t in (query, key, value))
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    tgt, batch, embed = query.shape
    src = key.shape[0]
    if embed != embed_dim_to_check or embed % num_heads:
        raise ValueError(f"{_NAME}: the query's embedding is {embed}, expected {embed_dim_to_check}, divisible by "
                         f"num_heads={num_heads}")
    head_dim = embed // num_heads
    q, k, v = _projections(query, key, value, in_proj_weight, in_proj_bias, use_separate_proj_weight,
                           (q_proj_weight, k_proj_weight, v_proj_weight))
    mask = _combined_mask(attn_mask, key_padding_mask, batch, num_heads, tgt, src, query.dtype)
    if is_causal and mask is not None:  # torch: is_causal is a hint when a mask is given; the mask decides
        is_causal = False
    out = call(F.scaled_dot_product_attention, _heads(q, tgt, batch, num_heads, head_dim),
               _heads(k, src, batch, num_heads, head_dim), _heads(v, src, batch, num_heads, head_dim),
               attn_mask=mask, dropout_p=dropout_p if training else 0.0, is_causal=is_causal)
    merged = call(torch.reshape, call(torch.permute, out, (2, 0, 1, 3)), (tgt, batch, embed))
    out = call(F.linear, merged, out_proj_weight, out_proj_bias)
    return (call(torch.squeeze, out, 1) if unbatched else out), None
