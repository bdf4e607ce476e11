"""Attention over a token grid: global SDPA and neighbourhood attention on the grid.

Usage::

    out = F.scaled_dot_product_attention(q, k, v)                 # q, k, v: (B, heads, tokens, hd) token grids
    out = domain.neighbourhood_attention(q, k, v, radius=2, grid=(h, w))   # window of +-2 tokens per grid dim

SDPA runs in the mode ``domain.attention_mode`` picks (``mesh3d.domain.attention.modes``): a ring of K/V
blocks, all keys gathered, or Ulysses. A mask (``attn_mask`` of global shape ``(..., N, N)``, ``is_causal``
or a window over the global token order) is indexed by the queries' and keys' global token indices, which
every rank knows from the grid's block sizes.

Neighbourhood attention: token ``(i, j)`` attends to the tokens ``(i', j')`` with ``|i - i'| <= r`` and
``|j - j'| <= r`` (per grid dim radii allowed). On a token grid each rank gathers a halo of ``r`` rows
per grid dim (one grid dim after the other, so corners travel), never the whole grid. The same call on
plain tensors (one process) takes ``grid=`` and is the reference; on slabs it is the 1-D window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mesh3d.domain.attention.modes import attention_step
from mesh3d.domain.attention.compiled import compiled_sharded_attention, takes
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.layouts.blocks import gather_along
from mesh3d.domain.ops.attention import neighbourhood_attention as slab_neighbourhood_attention
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.dispatch.registry import TOKEN_RULES
from mesh3d.domain.ops.mixed_attention import mixed_attention
from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.core.settings import traced

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
    mixed = mixed_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if mixed is not None:  # a plain conditioning (cross-attention), latent queries: ops/mixed_attention.py
        return mixed
    if traced() and query.spec.comm.size > 1 and takes(query, key, value, attn_mask):
        # NOTE: as on slabs, one custom op pair carries any mode in the graph (mesh3d/domain/attention/compiled.py)
        return compiled_sharded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # ring, gather or ulysses over the global token order (mesh3d/domain/attention/modes.py)
    return attention_step(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


TOKEN_RULES.register(F.scaled_dot_product_attention, _sdpa)


def _connected(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out``, or with no queries here, zeros that still reach the queries, keys and values in autograd.

    NOTE: torch's SDPA with no queries may return a result detached from the keys (with a boolean mask): the
    gather's backward, which every rank must join, would then not run on this rank, and the projections' weights
    would get no gradient here (the domain sum of gradients needs one on every rank).
    """
    if out.numel():
        return out
    return connected_zeros(out, list(out.shape), *(t for t in inputs if t is not None and t.requires_grad))


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
