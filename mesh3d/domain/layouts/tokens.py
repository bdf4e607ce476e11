"""Token grids: blocks flattened into one token dim (a ViT's ``flatten(2)``), with the global token order kept.

Usage::

    bs = domain.shard(x, dims=(2, 3))                 # blocks of (B, C, H, W) on a 2x2 domain grid
    e = patch_embed(bs); b, c, h, w = e.shape         # blocks of (B, C', H', W')
    t = e.flatten(2).transpose(1, 2) + pos_embedding  # a token grid (B, H'*W', C'), pos rows picked per token
    g = t.transpose(1, 2).reshape(b, c, h, w)         # blocks again
    t.full_tensor()                                    # the tokens in global (row-major) order

Flattening a block gives this rank's tokens in *block* order: rows ``o0..o0+n0`` of the grid, each
holding columns ``o1..o1+n1``. Those are not a contiguous run of the global row-major token order,
so a token grid is not a slab: its spec (``TokenSpec``) keeps the grid's block sizes, and every
rule that depends on positions reads this rank's global token indices (``global_index``) from it: a
position embedding of global shape ``(1, N, C)`` is indexed by them, ``full_tensor`` reorders by them,
masks of attention are built from them. Rules that do not depend on positions (Linear, LayerNorm over
channels, unmasked softmax attention, sums) run on the local tokens as they are. ``prefix`` tokens
(a class token ``torch.cat([cls, t], 1)``) come first in the global order and live on domain rank 0.
"""

from __future__ import annotations

import torch

from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.layouts.blocks import block_full_tensor
from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.comm.rows import Span, plan_exchange, runs_from_indices
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.linear import linear_op
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.comm.collectives import sum_grad

__all__ = ["blocks_spec", "blocks_to_tokens", "gather_all_tokens", "prefix_tokens", "slab_as_tokens",
           "token_full_tensor", "token_rows", "tokens_to_blocks"]


def blocks_to_tokens(local: torch.Tensor, spec: BlockSpec) -> tuple[torch.Tensor, TokenSpec]:
    """Flatten the block dims (consecutive, ascending) of this rank's block into tokens; no data moves.

    Usage: ``t, tspec = blocks_to_tokens(unwrap(e), e.spec)``
    """
    first = spec.dims[0]
    return local.flatten(first, spec.dims[-1]), TokenSpec(first, spec.sizes, spec.lines, spec.comm)


def tokens_to_blocks(local: torch.Tensor, spec: TokenSpec) -> tuple[torch.Tensor, BlockSpec]:
    """Unflatten this rank's tokens into its block of the grid; no data moves (there must be no prefix).

    Usage: ``g, bspec = tokens_to_blocks(unwrap(t), t.spec)``
    """
    return local.unflatten(spec.token_dim, spec.local_grid), blocks_spec(spec)


def blocks_spec(spec: TokenSpec) -> BlockSpec:
    """The blocks a token grid's tokens unflatten into (``tokens_to_blocks``)."""
    d = spec.token_dim
    return BlockSpec(tuple(range(d, d + len(spec.sizes))), spec.sizes, spec.lines, spec.comm)


def gather_all_tokens(local: torch.Tensor, spec: TokenSpec) -> torch.Tensor:
    """Every rank's tokens, in domain rank order (``spec.gathered_index`` gives their global indices).

    Differentiable: each rank's gradient for the gathered tokens goes back to their owners, which add them.
    Usage: ``k_all = gather_all_tokens(unwrap(k), k.spec)``
    """
    total = sum(spec.counts)
    everything = tuple((Span.rows(0, total),) for _ in spec.counts)
    return gather_rows(local, spec.token_dim, plan_exchange(spec.counts, everything, spec.comm.index), spec.comm)


def _whole_tokens(local: torch.Tensor, spec: TokenSpec) -> torch.Tensor:
    """Every token in global order (not differentiable by itself: ``token_full_tensor`` is)."""
    if spec.keys is not None:  # scores: the keys dim to the global order first
        local = local.index_select(spec.keys_dim, torch.argsort(spec.keys.gathered_index).to(local.device))
    if spec.prefix == 0:  # the blocks' gather, then one reshape: no permutation needed
        grid, bspec = tokens_to_blocks(local, spec)
        whole = unwrap(block_full_tensor(adopt(grid.detach(), bspec)))
        return whole.flatten(spec.token_dim, spec.token_dim + len(spec.sizes) - 1).clone()
    gathered = gather_all_tokens(local, spec)
    return gathered.index_select(spec.token_dim, torch.argsort(spec.gathered_index).to(local.device))


def _own_tokens(grad: torch.Tensor, spec: TokenSpec) -> torch.Tensor:
    """The replicated value's gradient is the same on every rank: this rank's tokens of it."""
    grad = grad.index_select(spec.token_dim, spec.global_index.to(grad.device))
    if spec.keys is not None:  # and back to the gathered order of the keys
        grad = grad.index_select(spec.keys_dim, spec.keys.gathered_index.to(grad.device))
    return grad


def slab_as_tokens(o: DomainTensor, spec: TokenSpec) -> torch.Tensor:
    """This rank's tokens of ``o``, a slab along the token dim in global (row-major) order: each rank fetches the runs
    of its block's rows from their owners (differentiable: gradients go back to them).

    Usage: ``local = slab_as_tokens(window_output, t.spec)  # a Swin's windows ran on slabs; its shortcut is tokens``
    """
    ospec = o._spec
    needs = tuple(runs_from_indices(spec.global_index_of(r).tolist()) for r in range(spec.comm.size))
    return gather_rows(unwrap(o), ospec.dim, plan_exchange(ospec.sizes, needs, spec.comm.index), spec.comm)


def token_full_tensor(x: DomainTensor) -> DomainTensor:
    """Every token in global order on every domain rank, replicated (differentiable).

    Usage: ``whole = t.full_tensor()``
    """
    spec = x._spec
    assert isinstance(spec, TokenSpec)
    whole = linear_op(lambda t: _whole_tokens(t, spec), lambda g: _own_tokens(g, spec), unwrap(x))
    return adopt(whole, DomainSpec.replicated(spec.comm))


def token_rows(o: torch.Tensor, dim: int, spec: TokenSpec, op: str, gathered: bool = False) -> torch.Tensor:
    """This rank's rows of ``o`` along ``dim``: ``o`` as is when its size there is 1, its rows at this rank's global
    token indices when it has one per token (a position embedding); a replicated value's gradient is summed.
    ``gathered``: every token, in the order ``gather_all_tokens`` returns them (the keys of attention scores).

    Usage: ``pos = token_rows(pos_embedding, 1, t.spec, "torch.add")``
    """
    plain = sum_grad(unwrap(o), spec.comm) if isinstance(o, DomainTensor) and o.requires_grad else unwrap(o)
    if dim < 0 or plain.shape[dim] == 1:
        return plain
    if plain.shape[dim] == spec.global_tokens:
        return plain.index_select(dim, (spec.gathered_index if gathered else spec.global_index).to(plain.device))
    raise ValueError(f"{op}: a tensor of shape {tuple(plain.shape)} meets a token grid of {spec.global_tokens} tokens "
                     f"along dim {dim}; give it {spec.global_tokens} rows there (one per token, in global order) or 1")


def prefix_tokens(local: torch.Tensor, spec: TokenSpec, start: int, stop: int) -> torch.Tensor:
    """Global tokens ``[start, stop)`` (prefix tokens, held by domain rank 0) on every rank, as a replicated value:
    differentiable, its gradient kept once, by rank 0 (every rank's is the same).

    Usage: ``cls = prefix_tokens(unwrap(t), t.spec, 0, 1)``
    """
    shape = local.shape  # NOTE: backward keeps rank 0's share
    return linear_op(lambda t: _take(t, spec, start, stop), lambda g: _give_back(g, spec, start, shape), local)


def _take(local: torch.Tensor, spec: TokenSpec, start: int, stop: int) -> torch.Tensor:
    needs = tuple((Span.rows(start, stop),) for _ in spec.counts)  # rank 0 holds global rows 0.. first
    out = gather_rows(local, spec.token_dim, plan_exchange(spec.counts, needs, spec.comm.index), spec.comm)
    return out.clone() if out is local else out  # NOTE: memory of its own, as a replicated value's is


def _give_back(grad: torch.Tensor, spec: TokenSpec, start: int, shape: torch.Size) -> torch.Tensor:
    out = grad.new_zeros(shape)
    if spec.comm.index == 0:  # the value is replicated: its gradient is too, so the owner keeps it once
        out.narrow(spec.token_dim, start, grad.shape[spec.token_dim]).copy_(grad)
    return out
