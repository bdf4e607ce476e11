"""Making and unmaking domain tensors: ``shard``, ``scatter``, ``from_local``, ``full_tensor``.

Usage::

    from mesh3d import domain
    xs = domain.shard(x, dim=2)                   # every rank holds x; keeps its own slice
    xs = domain.scatter(x, dim=2, src=0)          # only domain rank 0 holds x (others pass None)
    xs = domain.from_local(local, dim=2, sizes=(5, 3, 4))   # each rank loaded its own slab
    y.full_tensor()                               # the whole tensor on every domain rank

All checks on arguments run before any communication, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mesh3d.domain.comm.rows import block_needs
from mesh3d.domain.layouts.slabs import redistribute_local
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import exchange_all, gather_rows
from mesh3d.domain.layouts.blocks import shard_blocks
from mesh3d.domain.layouts.blocks_local import blocks_from_local
from mesh3d.domain.comm.rows import plan_exchange
from mesh3d.domain.core.plan_cache import plan_cache
from mesh3d.domain.dispatch.layout_registry import LAYOUTS
from mesh3d.domain.layouts.relayout import relayout
from mesh3d.domain.core.split import aligned_sizes, split_sizes
from mesh3d.domain.layouts.transpose import move_sharding
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap, wrap, wrap_anew
from mesh3d.launcher import refuse_if_launched_uninitialized
from mesh3d.manager import DistributedManager

__all__ = ["domain_comm", "from_local", "full_tensor", "redistribute", "scatter", "shard"]

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8)


class _CommOfMesh:
    """The domain comm of the manager's current mesh, made once per mesh (``dm.epoch``).

    NOTE: asking the device mesh for the group's ranks and this rank's index costs ~25 us of Python, paid by every
    ``domain.shard`` of every step: 120 us with cold caches between two steps, 3% of a small compiled step."""

    def __init__(self) -> None:
        self.comm: DomainComm | None = None

    def of(self, dm: DistributedManager) -> DomainComm:
        if self.comm is None or self.comm.mesh_epoch != dm.epoch:
            self.comm = DomainComm("domain", tuple(dm.axis_ranks("domain")), dm.axis_rank("domain"), dm.epoch)
        return self.comm

    def forget(self) -> None:
        """Let the comm go with its mesh (``DistributedManager.on_shutdown``)."""
        self.comm = None


_COMM_OF_MESH = _CommOfMesh()
DistributedManager.on_shutdown(_COMM_OF_MESH.forget)


def domain_comm() -> DomainComm:
    """This rank's domain group (from ``DistributedManager``); a one-rank domain without one.

    Usage: ``comm = domain_comm(); comm.size, comm.index``
    """
    if not DistributedManager.is_initialized():
        refuse_if_launched_uninitialized("mesh3d.domain")
        return DomainComm(None, (dist.get_rank() if dist.is_initialized() else 0,), 0)
    return _COMM_OF_MESH.of(DistributedManager())


def _check_dim(op: str, dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"domain.{op}: dim={dim!r} is out of range for a {ndim}-D tensor (use 0..{ndim - 1})")
    return dim % ndim


def _layout(length: int, parts: int, sizes: Sequence[int] | None, multiple_of: int | None) -> tuple[int, ...]:
    if multiple_of is None:
        return split_sizes(length, parts, sizes)
    if sizes is not None:
        raise ValueError(f"pass sizes= or multiple_of=, not both (got sizes={tuple(sizes)}, multiple_of={multiple_of})")
    return split_sizes(length, parts, aligned_sizes(length, parts, multiple_of))


@plan_cache(maxsize=256)
def _slab_spec(length: int, dim: int, sizes: tuple[int, ...] | None, multiple_of: int | None,
               comm: DomainComm) -> DomainSpec:
    """The spec of one slab layout, made once. NOTE: ``shard`` runs on every step's input; splitting the dim and
    building the spec cost ~10 us there with the caches cold after a compiled step (tiny D=1 step, this CPU)."""
    return DomainSpec(dim, _layout(length, comm.size, sizes, multiple_of), comm)


def shard(x: torch.Tensor, dim: int = 2, sizes: Sequence | None = None, *,
          multiple_of: int | None = None, dims: Sequence[int] | None = None) -> DomainTensor:
    """Keep this rank's slice of ``x`` (held whole on every domain rank) along ``dim``.

    Usage: ``xs = domain.shard(x, dim=2)  # or sizes=(5, 3, 4, 4), or multiple_of=16``

    ``multiple_of=m`` makes every rank's size but the last a multiple of m: for models that
    downsample the dim by m, so no rank keeps a sliver after pooling (see ``downsampling_factor``).
    ``dims=(2, 3)`` on a domain grid (``initialize(domain=(2, 2))``) keeps this rank's *block*, one
    sharded dim per grid dim; ``sizes`` then gives each dim's sizes, e.g. ``((5, 3), (4, 4))``.
    """
    if isinstance(x, DomainTensor):
        raise ValueError("domain.shard: x is already a domain tensor; pass the plain whole tensor")
    comm = domain_comm()
    if dims is not None:
        if multiple_of is not None:
            raise ValueError("domain.shard: multiple_of= applies to slabs; with dims= give sizes= per dim")
        return shard_blocks(x, dims, sizes, comm)
    dim = _check_dim("shard", dim, x.ndim)
    if sizes is None or all(type(s) is int for s in sizes):
        spec = _slab_spec(x.shape[dim], dim, None if sizes is None else tuple(sizes), multiple_of, comm)
    else:  # not a layout to remember: _layout raises, saying what sizes= must be
        spec = DomainSpec(dim, _layout(x.shape[dim], comm.size, sizes, multiple_of), comm)
    sizes = spec.sizes
    if sizes[comm.index] == x.shape[dim]:  # the whole dim (one rank): no slice, so no slice backward (a full copy)
        return wrap_anew(x, spec)
    # NOTE: a contiguous shard, as the whole tensor is: its metadata (is_contiguous, views) then answers alike.
    return adopt(x.narrow(dim, spec.offset, sizes[comm.index]).contiguous(), spec)


def from_local(local: torch.Tensor, dim: int | None = None, sizes: Sequence | None = None, *,
               dims: Sequence[int] | None = None) -> DomainTensor:
    """Wrap this rank's own slab (every rank passes the same ``sizes``; no communication).

    Usage: ``xs = domain.from_local(my_slab, dim=2, sizes=(12, 10, 10))``; on a domain grid, a block:
    ``domain.from_local(my_block, dims=(2, 3), sizes=((5, 3), (4, 4)))``
    """
    comm = domain_comm()
    if dims is not None:
        return blocks_from_local(local, dims, sizes, comm)
    if dim is None or sizes is None:
        raise ValueError("domain.from_local: pass dim= and sizes= (a slab), or dims= and sizes= (a block)")
    dim = _check_dim("from_local", dim, local.ndim)
    sizes = split_sizes(sum(sizes), comm.size, sizes)
    if local.shape[dim] != sizes[comm.index]:
        raise ValueError(
            f"domain.from_local: this rank's slab has {local.shape[dim]} rows along dim {dim} but "
            f"sizes[{comm.index}]={sizes[comm.index]}"
        )
    return wrap_anew(local, DomainSpec(dim, sizes, comm))


def scatter(x: torch.Tensor | None, dim: int = 2, src: int = 0, sizes: Sequence[int] | None = None, *,
            multiple_of: int | None = None) -> DomainTensor:
    """Send each domain rank only its own slice of ``x``, held by domain rank ``src`` (others pass None).

    Usage: ``xs = domain.scatter(x if dm.axis_rank("domain") == 0 else None, dim=2, src=0)``

    Point-to-point sends from ``src``: no rank but ``src`` ever holds more than its slice. Only the
    shape and dtype are broadcast first (a few integers). Differentiable: ``x.grad`` on ``src``
    collects every rank's gradient.
    """
    comm = domain_comm()
    if not isinstance(src, int) or not 0 <= src < comm.size:
        raise ValueError(f"domain.scatter: src={src!r} must be a domain rank index in 0..{comm.size - 1}")
    is_src = comm.index == src
    if is_src and x is None:
        raise ValueError("domain.scatter: the src rank must pass the tensor to scatter")
    meta = torch.zeros(10, dtype=torch.long)
    if is_src:
        if x.ndim > 8 or x.dtype not in _DTYPES:
            raise ValueError(f"domain.scatter: supports up to 8-D tensors of dtype in {_DTYPES}")
        meta[0], meta[1] = x.ndim, _DTYPES.index(x.dtype)
        meta[2:2 + x.ndim] = torch.tensor(x.shape)
    if comm.size > 1:  # NOTE: the src rank's header through the domain's checked transport (its timeout, its journal)
        meta = exchange_all(meta, comm)[src]
    ndim, dtype = int(meta[0]), _DTYPES[int(meta[1])]
    shape = [int(v) for v in meta[2:2 + ndim]]
    dim = _check_dim("scatter", dim, ndim)
    sizes = _layout(shape[dim], comm.size, sizes, multiple_of)  # every rank raises alike: same broadcast shape
    if not is_src:
        shape[dim] = 0
        x = torch.zeros(shape, dtype=dtype)
    holder = tuple(sum(sizes) if r == src else 0 for r in range(comm.size))
    local = gather_rows(unwrap(x), dim, plan_exchange(holder, block_needs(sizes), comm.index), comm)
    return wrap(local, DomainSpec(dim, sizes, comm))


def full_tensor(x: DomainTensor) -> DomainTensor:
    """The whole tensor on every domain rank (differentiable), as a *replicated* domain tensor; any layout.

    Usage: ``whole = domain.full_tensor(ys)  # or ys.full_tensor()``
    """
    entry = LAYOUTS.of(x._spec.layout)
    return x if entry is None else entry.full_tensor(x)  # NOTE: None: replicated, whole already


def redistribute(x: DomainTensor, sizes: Sequence | None = None, dim: int | None = None, *,
                 dims: Sequence[int] | None = None) -> DomainTensor:
    """The same tensor with new per-rank sizes along its sharded dim, or sharded along another ``dim``.

    Usage: ``ys = domain.redistribute(xs, (4, 4, 4, 4))``; ``zs = domain.redistribute(xs, dim=1)`` (dim 1
    becomes the sharded one, ``sizes`` along it, and the old sharded dim whole: an all-to-all, uneven allowed)

    On a domain grid, ``dims=(2, 3)`` moves slabs to blocks (``sizes`` per dim) and ``dim=2`` blocks to slabs.
    Only moved rows travel.
    """
    moved = relayout(x, dim, dims, sizes)
    if moved is not None:
        return moved
    if dim is not None and dim % x.ndim != x.spec.dim:
        return move_sharding(x, dim, sizes)
    new = split_sizes(sum(x.spec.sizes), x.spec.comm.size, sizes)
    if new == x.spec.sizes:
        return x
    return adopt(redistribute_local(x, new), x.spec.with_sizes(new))
