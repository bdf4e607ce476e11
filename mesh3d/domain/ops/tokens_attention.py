"""Attention over a token grid: global SDPA and neighbourhood attention on the grid.

Usage::

    out = F.scaled_dot_product_attention(q, k, v)                 # q, k, v: (B, heads, tokens, hd) token grids
    out = domain.neighbourhood_attention(q, k, v, radius=2, grid=(h, w))   # window of +-2 tokens per grid dim

SDPA: each rank keeps its queries and gathers every rank's keys and values (in domain rank order).
Unmasked softmax attention does not depend on the keys' order, so no reordering is needed; a mask
(``attn_mask`` of global shape ``(..., N, N)``, or ``is_causal`` over the global token order) is indexed
by the queries' and the gathered keys' global token indices. The backward sends each rank's key/value
gradients to their owners, which add them.

Neighbourhood attention: token ``(i, j)`` attends to the tokens ``(i', j')`` with ``|i - i'| <= r`` and
``|j - j'| <= r`` (per grid dim radii allowed). On a token grid each rank gathers a halo of ``r`` rows
per grid dim (one grid dim after the other, so corners travel), never the whole grid. The same call on
plain tensors (one process) takes ``grid=`` and is the reference; on slabs it is the 1-D window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mesh3d.domain.blocks import BlockSpec, gather_along
from mesh3d.domain.ops.attention import neighbourhood_attention as slab_neighbourhood_attention
from mesh3d.domain.ops.conv import weight_connected_zeros
from mesh3d.domain.registry import TOKEN_RULES
from mesh3d.domain.rows import Span
from mesh3d.domain.split import offsets_of
from mesh3d.domain.tensor import DomainTensor, adopt, sharded_dims, unwrap
from mesh3d.domain.tokens import TokenSpec, gather_all_tokens

__all__ = ["neighbourhood_attention"]


def _check(op: str, q, k, v) -> TokenSpec:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not (isinstance(t, DomainTensor) and isinstance(t._spec, TokenSpec) and t._spec.token_dim == t.ndim - 2
                and t._spec.keys is None):
            raise ValueError(f"{op} on a token grid: the {name} must be a token grid with its tokens at dim -2 "
                             "(B, heads, tokens, head_dim)")
    if k._spec != v._spec:
        raise ValueError(f"{op}: key and value must be laid out alike")
    return k._spec


def _kv(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """Keys and values stacked along the features when they can travel as one message."""
    if key.shape[:-1] != value.shape[:-1]:
        return key, None
    return torch.cat([key, value], -1), key.shape[-1]


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    kspec = _check("scaled_dot_product_attention", query, key, value)
    qspec = query._spec
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention on a token grid: dropout_p must be 0 (a per-rank "
                                  "random mask would not match one process)")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal, not both")
    if isinstance(attn_mask, DomainTensor) and sharded_dims(attn_mask._spec):
        raise NotImplementedError("scaled_dot_product_attention on a token grid: attn_mask must be a plain or "
                                  "replicated (..., N, N) tensor over the global token order")
    k, v = unwrap(key), unwrap(value)
    both, width = _kv(k, v)
    gathered = gather_all_tokens(both, kspec) if width is not None else None
    k_all = gathered[..., :width] if gathered is not None else gather_all_tokens(k, kspec)
    v_all = gathered[..., width:] if gathered is not None else gather_all_tokens(v, kspec)
    mask = None
    if attn_mask is not None or is_causal:
        rows, cols = qspec.global_index.to(k.device), kspec.gathered_index.to(k.device)
        if is_causal:
            mask = rows[:, None] >= cols[None, :]
        else:
            mask = unwrap(attn_mask).index_select(-2, rows).index_select(-1, cols)
    q = unwrap(query)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return adopt(_connected(out, q, k_all, v_all, mask), qspec)


TOKEN_RULES.register(F.scaled_dot_product_attention, _sdpa)


def _connected(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out``, or with no queries here, zeros that still reach the queries, keys and values in autograd.

    NOTE: torch's SDPA with no queries may return a result detached from the keys (with a boolean mask): the
    gather's backward, which every rank must join, would then not run on this rank, and the projections' weights
    would get no gradient here (the domain sum of gradients needs one on every rank).
    """
    if out.numel():
        return out
    return weight_connected_zeros(out, list(out.shape), *(t for t in inputs if t is not None and t.requires_grad))


def _window_mask(q_ranges: Sequence[range], k_ranges: Sequence[range], radius: Sequence[int],
                 device: torch.device) -> torch.Tensor:
    """(queries, keys) bool mask: every grid coordinate within its radius; both in row-major grid order."""
    def coords(ranges):
        axes = [torch.arange(r.start, r.stop, device=device) for r in ranges]
        return [c.flatten() for c in torch.meshgrid(*axes, indexing="ij")]
    mask = None
    for qc, kc, r in zip(coords(q_ranges), coords(k_ranges), radius):
        near = (qc[:, None] - kc[None, :]).abs() <= r
        mask = near if mask is None else mask & near
    assert mask is not None
    return mask


def _radii(radius: int | Sequence[int], nd: int) -> tuple[int, ...]:
    radii = tuple(radius) if isinstance(radius, (tuple, list)) else (radius,) * nd
    if len(radii) != nd or any(not isinstance(r, int) or r < 0 for r in radii):
        raise ValueError(f"neighbourhood_attention: radius={radius!r} must be a non-negative int or one per grid dim "
                         f"({nd})")
    return radii


def _on_token_grid(q: DomainTensor, k: DomainTensor, v: DomainTensor, radius, grid) -> DomainTensor:
    spec = _check("neighbourhood_attention", q, k, v)
    if spec.prefix or q._spec != spec:
        raise ValueError("neighbourhood_attention on a token grid: queries, keys and values must be the grid's tokens "
                         "laid out alike, without prefix tokens (drop class tokens first: t[:, 1:])")
    if grid is not None and tuple(int(g) for g in grid) != spec.grid_shape:
        raise ValueError(f"neighbourhood_attention: grid={tuple(int(g) for g in grid)} but the tokens form "
                         f"a {spec.grid_shape} grid")
    radii = _radii(radius, len(spec.sizes))
    d = spec.token_dim
    both, width = _kv(unwrap(k), unwrap(v))
    if width is None:
        raise NotImplementedError("neighbourhood_attention on a token grid: keys and values must share their leading "
                                  f"dims (got {tuple(k.shape)} and {tuple(v.shape)})")
    local = both.unflatten(d, spec.local_grid)
    bspec = BlockSpec(tuple(range(d, d + len(spec.sizes))), spec.sizes, spec.lines, spec.comm)
    key_ranges = []
    for axis, (sizes, r) in enumerate(zip(spec.sizes, radii)):
        n = sum(sizes)
        needs = tuple((Span.rows(max(o - r, 0), min(o + s + r, n)),) if s else ()
                      for o, s in zip(offsets_of(sizes), sizes))
        local = gather_along(local, bspec, axis, needs)  # the second pass moves extended rows: corners travel
        mine = needs[spec.lines[axis].index]
        key_ranges.append(range(mine[0].start, mine[0].stop) if mine else range(0))
    ext = local.flatten(d, d + len(spec.sizes) - 1)
    k_ext, v_ext = ext[..., :width], ext[..., width:]
    query_ranges = [range(o, o + n) for o, n in zip(bspec.offsets, bspec.local_sizes)]
    mask = _window_mask(query_ranges, key_ranges, radii, k_ext.device)
    out = F.scaled_dot_product_attention(unwrap(q), k_ext, v_ext, attn_mask=mask)
    return adopt(_connected(out, unwrap(q), k_ext, v_ext, mask), q._spec)


def neighbourhood_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, radius: int | Sequence[int],
                            grid: Sequence[int] | None = None) -> torch.Tensor:
    """Attention within a window of ``radius`` tokens around each query, on a token grid, slabs or plain tensors.

    Usage: ``out = domain.neighbourhood_attention(q, k, v, radius=2, grid=(h, w))  # (B, heads, h*w, hd)``

    ``grid``: the token grid's shape (global; ``e.shape[2:]`` of the patch embedding works on every layout). With
    no ``grid``, the tokens are a 1-D sequence. On a token grid the grid comes from the layout.
    """
    if isinstance(q, DomainTensor) and isinstance(q._spec, TokenSpec):
        return _on_token_grid(q, k, v, radius, grid)
    if isinstance(q, DomainTensor) and (grid is None or len(grid) == 1) and q._spec.dim is not None:
        return slab_neighbourhood_attention(q, k, v, _radii(radius, 1)[0])
    if isinstance(q, DomainTensor):
        raise NotImplementedError("neighbourhood_attention over a multi-dim grid on slabs: shard the grid as blocks "
                                  "(domain.shard(x, dims=...)) and flatten them into tokens")
    shape = tuple(int(g) for g in grid) if grid is not None else (q.shape[-2],)
    radii = _radii(radius, len(shape))
    ranges = [range(n) for n in shape]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(ranges, ranges, radii, q.device))
