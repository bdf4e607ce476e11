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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from typing import ClassVar

import torch

from mesh3d.domain.blocks import BlockSpec, block_full_tensor, grid_coords
from mesh3d.domain.exchange import DomainComm, gather_rows
from mesh3d.domain.rows import Span, plan_exchange
from mesh3d.domain.split import offsets_of
from mesh3d.domain.tensor import DomainSpec, DomainTensor, adopt, unwrap
from mesh3d.domain.plan_cache import plan_property

__all__ = ["TokenSpec", "blocks_to_tokens", "gather_all_tokens", "token_full_tensor", "tokens_to_blocks"]


@dataclass(frozen=True)
class TokenSpec:
    """A token dim flattened from blocks: grid block ``sizes`` (one tuple per grid dim), this rank's grid
    ``lines``, the domain ``comm``, and ``prefix`` leading tokens held by domain rank 0.

    Usage: ``t.spec.token_dim, t.spec.global_index, t.spec.counts``
    """

    token_dim: int
    sizes: tuple[tuple[int, ...], ...]
    lines: tuple[DomainComm, ...]
    comm: DomainComm
    prefix: int = 0
    #: attention scores (``q @ k.transpose(-1, -2)``): dim ``keys_dim`` holds every key token of the grid ``keys``,
    #: in the order ``keys.gathered_index`` (domain rank order), not the global one
    keys: TokenSpec | None = None
    keys_dim: int | None = None

    #: the dispatcher reads ``registry.TOKEN_RULES`` for tensors with this spec
    is_token_grid: ClassVar[bool] = True

    @property
    def dims(self) -> tuple[int, ...]:
        """The sharded tensor dims (the token dim): what the dispatcher and ``.shape`` read."""
        return (self.token_dim,)

    @property
    def dim(self) -> int:
        # NOTE: as on blocks: code written for slabs reads ``spec.dim``; a token grid is not a slab.
        raise NotImplementedError(
            "this operation supports slabs only; the tensor is a token grid (blocks flattened into tokens). "
            "Reshape it back to the grid, gather it with .full_tensor(), or see docs/domain.md 'Token grids'")

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The global token grid (``(H', W')``)."""
        return tuple(sum(s) for s in self.sizes)

    @property
    def global_tokens(self) -> int:
        return self.prefix + math.prod(self.grid_shape)

    @plan_property
    def local_grid(self) -> tuple[int, ...]:
        """This rank's block of the token grid (rows along each grid dim)."""
        return tuple(s[line.index] for s, line in zip(self.sizes, self.lines))

    @plan_property
    def counts(self) -> tuple[int, ...]:
        """Tokens held by each domain rank, in domain rank order (prefix tokens on rank 0)."""
        grid = tuple(len(s) for s in self.sizes)
        out = []
        for r in range(self.comm.size):
            coords = grid_coords(r, grid)
            out.append(math.prod([s[c] for s, c in zip(self.sizes, coords)]) + (self.prefix if r == 0 else 0))
        return tuple(out)

    def global_index_of(self, rank: int) -> torch.Tensor:
        """Global token indices of domain rank ``rank``'s tokens, in its local order (int64)."""
        grid = tuple(len(s) for s in self.sizes)
        coords = grid_coords(rank, grid)
        index = torch.zeros((), dtype=torch.long)
        for sizes, c, n in zip(self.sizes, coords, self.grid_shape):
            start = offsets_of(sizes)[c]
            index = index.unsqueeze(-1) * n + torch.arange(start, start + sizes[c])
        index = index.flatten() + self.prefix
        return torch.cat([torch.arange(self.prefix), index]) if rank == 0 and self.prefix else index

    @plan_property
    def global_index(self) -> torch.Tensor:
        """This rank's tokens' global indices (row-major over the grid, after the prefix), in local order."""
        return self.global_index_of(self.comm.index)

    @plan_property
    def gathered_index(self) -> torch.Tensor:
        """Global indices of every rank's tokens, in domain rank order (what ``gather_all_tokens`` returns)."""
        return torch.cat([self.global_index_of(r) for r in range(self.comm.size)])

    def with_token_dim(self, token_dim: int, keys_dim: int | None = None) -> TokenSpec:
        """The same tokens along another dim (and the scores' keys along ``keys_dim``)."""
        if token_dim == self.token_dim and keys_dim == self.keys_dim:
            return self
        return replace(self, token_dim=token_dim, keys_dim=keys_dim)

    def with_prefix(self, prefix: int) -> TokenSpec:
        return self if prefix == self.prefix else replace(self, prefix=prefix)

    def with_keys(self, keys: TokenSpec | None, keys_dim: int | None) -> TokenSpec:
        """Scores of these queries against every token of ``keys`` (None: back to plain tokens)."""
        return replace(self, keys=None if keys is None else replace(keys, token_dim=0), keys_dim=keys_dim)

    def moved(self, new_position: Callable[[int], int]) -> TokenSpec:
        """The spec after a dim permutation (``new_position(old dim)``), the scores' keys dim moving too."""
        keys_dim = None if self.keys_dim is None else new_position(self.keys_dim)
        return self.with_token_dim(new_position(self.token_dim), keys_dim)

    def global_shape(self, local_shape: Sequence[int]) -> torch.Size:
        shape = list(local_shape)
        shape[self.token_dim] = self.global_tokens
        return torch.Size(shape)


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
    d = spec.token_dim
    dims = tuple(range(d, d + len(spec.sizes)))
    return local.unflatten(d, spec.local_grid), BlockSpec(dims, spec.sizes, spec.lines, spec.comm)


def gather_all_tokens(local: torch.Tensor, spec: TokenSpec) -> torch.Tensor:
    """Every rank's tokens, in domain rank order (``spec.gathered_index`` gives their global indices).

    Differentiable: each rank's gradient for the gathered tokens goes back to their owners, which add them.
    Usage: ``k_all = gather_all_tokens(unwrap(k), k.spec)``
    """
    total = sum(spec.counts)
    everything = tuple((Span.rows(0, total),) for _ in spec.counts)
    return gather_rows(local, spec.token_dim, plan_exchange(spec.counts, everything, spec.comm.index), spec.comm)


class _TokenFullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: TokenSpec) -> torch.Tensor:
        ctx.spec = spec
        with torch.no_grad():
            if spec.keys is not None:  # scores: the keys dim to the global order first
                local = local.index_select(spec.keys_dim, torch.argsort(spec.keys.gathered_index).to(local.device))
            if spec.prefix == 0:  # the blocks' gather, then one reshape: no permutation needed
                grid, bspec = tokens_to_blocks(local, spec)
                whole = unwrap(block_full_tensor(adopt(grid.detach(), bspec)))
                return whole.flatten(spec.token_dim, spec.token_dim + len(spec.sizes) - 1).clone()
            gathered = gather_all_tokens(local, spec)
            return gathered.index_select(spec.token_dim, torch.argsort(spec.gathered_index).to(local.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec  # the replicated value's gradient is the same on every rank: keep this rank's tokens
        grad = grad.index_select(spec.token_dim, spec.global_index.to(grad.device))
        if spec.keys is not None:  # and back to the gathered order of the keys
            grad = grad.index_select(spec.keys_dim, spec.keys.gathered_index.to(grad.device))
        return grad, None


def token_full_tensor(x: DomainTensor) -> DomainTensor:
    """Every token in global order on every domain rank, replicated (differentiable).

    Usage: ``whole = t.full_tensor()``
    """
    spec = x._spec
    assert isinstance(spec, TokenSpec)
    return adopt(_TokenFullTensor.apply(unwrap(x), spec), DomainSpec.replicated(spec.comm))
