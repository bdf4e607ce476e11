"""Moving the sharded dim to another dim (an all-to-all by point-to-point messages), uneven shards included.

Usage::

    ys = move_sharding(xs, dim=1)                  # xs sharded along 2 -> ys sharded along 1, dim 2 whole
    zs = move_sharding(ys, dim=2, sizes=xs.sizes)  # and back, to the original layout

Rank r holds rows ``[o_r, o_r + s_r)`` of dim ``d`` and all of dim ``e``. After the move it holds all
of ``d`` and the block ``t_r`` of ``e``: it sends rank q the piece (its rows of ``d``) x (q's block
of ``e``) and receives from every q the piece (q's rows of ``d``) x (its block of ``e``), placed
in rank order along ``d``. Empty shards send and receive nothing. The backward is the reverse move
of the gradient (the exact adjoint: every element has one owner before and after). Complex tensors
travel as their real view. This is what spectral rules (``ops/spectral.py``) use so that the
transformed dims are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import run_exchange, exchange_point
from mesh3d.domain.core.split import offsets_of, split_sizes
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.linear import linear_op
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap

__all__ = ["move_local", "move_rows", "move_sharding"]


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def move_local(local: torch.Tensor, comm: DomainComm, src_dim: int, src_sizes: Sequence[int],
               dst_dim: int, dst_sizes: Sequence[int]) -> torch.Tensor:
    """The all-to-all on plain local tensors (not differentiable by itself; ``move_sharding`` is).

    Usage: ``out = move_local(local, comm, 2, (3, 0, 5), 1, (2, 1, 1))``
    """
    me = comm.index
    dst_off = offsets_of(dst_sizes)
    local = local.contiguous().resolve_conj().resolve_neg()  # NOTE: a lazy conjugate has no real view to send
    outgoing, incoming = [], []
    out_shape = list(local.shape)
    out_shape[src_dim], out_shape[dst_dim] = sum(src_sizes), dst_sizes[me]
    pieces = []
    for q in range(comm.size):
        piece_shape = list(out_shape)
        piece_shape[src_dim] = src_sizes[q]
        if q == me:
            pieces.append(local.narrow(dst_dim, dst_off[me], dst_sizes[me]))
            continue
        outgoing.append((q, local.narrow(dst_dim, dst_off[q], dst_sizes[q]).contiguous()))
        buf = local.new_empty(piece_shape)
        incoming.append((q, buf))
        pieces.append(buf)
    # NOTE: the header round first (as for halos): ranks whose shapes diverged (a spectrum built from local
    # shapes) then raise DomainDivergenceError together instead of gloo aborting on a message size mismatch.
    run_exchange(comm, [(q, _real(b)) for q, b in outgoing], [(q, _real(b)) for q, b in incoming], exchange_point(comm))
    return torch.cat(pieces, src_dim)


def move_rows(local: torch.Tensor, comm: DomainComm, src_dim: int, src_sizes: Sequence[int], dst_dim: int,
              dst_sizes: Sequence[int]) -> torch.Tensor:
    """Differentiable ``move_local``: ``src_dim`` (sharded as ``src_sizes``) made whole, ``dst_dim`` sharded as
    ``dst_sizes``, over any 1-D group of ranks (a domain, or one grid line of blocks).

    Usage: ``local = move_rows(local, line, 2, (5, 3), 1, (2, 2))``
    """
    if comm.size == 1:
        return local
    src, dst = tuple(src_sizes), tuple(dst_sizes)
    return linear_op(lambda t: move_local(t, comm, src_dim, src, dst_dim, dst),
                     lambda g: move_local(g, comm, dst_dim, dst, src_dim, src), local)


def move_sharding(x: DomainTensor, dim: int, sizes: Sequence[int] | None = None) -> DomainTensor:
    """``x`` sharded along ``dim`` instead (``sizes`` along it: ``torch.chunk``'s by default), its old dim whole.

    Usage: ``ys = move_sharding(xs, dim=1)``
    """
    spec = x.spec
    if spec.dim is None:
        raise ValueError("move_sharding: x is replicated (not sharded); use domain.shard on it instead")
    dim = dim % x.ndim
    new_sizes = split_sizes(size_of(x)[dim], spec.comm.size, sizes)
    if dim == spec.dim:
        raise ValueError(f"move_sharding: x is already sharded along dim {dim}; use domain.redistribute(x, sizes=...)")
    local = unwrap(x)
    if spec.comm.size == 1:
        return adopt(local.view_as(local), DomainSpec(dim, new_sizes, spec.comm, 1))
    return adopt(move_rows(local, spec.comm, spec.dim, spec.sizes, dim, new_sizes), DomainSpec(dim, new_sizes, spec.comm, 1))
