"""Blocks: a sample sharded over several dims at once, one per dim of a factored domain grid.

Usage::

    dm = DistributedManager.initialize(batch=1, domain=(2, 2))      # a 2x2 grid of domain ranks
    xs = domain.shard(x, dims=(2, 3))                                # this rank's block of x
    xs = domain.shard(x, dims=(2, 3), sizes=((5, 3), (4, 4)))        # uneven, empty blocks allowed
    y = conv(xs); y.full_tensor()                                    # halos with corners

Grid dim ``i`` splits tensor dim ``dims[i]``; rank (i0, i1, ...) of the grid holds rows
``offsets[k][ik] .. + sizes[k][ik]`` of each. The ranks that share every grid coordinate but
the ``i``-th form a *grid line* (``dm.group("domain_i")``): a 1-D domain along ``dims[i]``. So
every exchange on blocks is a sequence of 1-D exchanges, one per grid dim, each on the grid
line's ranks with the 1-D planners and ``exchange.gather_rows``: the second pass moves rows that
the first pass already extended, which carries the corners. Where the rows a rank needs form a box
(window halos, transposed convolutions, ``F.pad``, upsampling), ``blocks_halo`` posts every
neighbour's box (corners included) in one round on the whole domain group instead. Global
reductions run over the whole domain group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from mesh3d.domain.halo.boxes import gather_box
from mesh3d.domain.comm.rows import block_needs
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import gather_rows
from mesh3d.domain.halo.windows import WindowPlan, plan_window
from mesh3d.domain.comm.rows import ExchangePlan, Span, plan_exchange
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.linear import linear_op
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap, wrap_anew
from mesh3d.manager import DistributedManager
from mesh3d.domain.core.plan_cache import plan_cache
from mesh3d.domain.core.specs import BlockSpec

__all__ = ["SimulatedGrid", "block_full_tensor", "box_plans", "gather_along", "gather_planned", "grid_comms",
           "halo_rows_only", "in_layout", "layout_gathers", "replicate_blocks_if_singleton", "shard_blocks",
           "simulated_grid", "window_plans"]


class SimulatedGrid:
    """The domain grid and grid lines a simulated rank stands on (``mesh3d plan``: no manager, no process group),
    taken by ``grid_comms`` in place of the manager's while ``simulated_grid`` is active.

    Usage: ``with simulated_grid((2, 2), lines): model(x_on_meta)``
    """

    _active: list[tuple[tuple[int, ...], tuple[DomainComm, ...]]] = []  # innermost last


@contextlib.contextmanager
def simulated_grid(grid: tuple[int, ...], lines: tuple[DomainComm, ...]) -> Iterator[None]:
    """``grid_comms()`` answers ``(grid, lines)`` inside the block (a slab moved to blocks on a simulated rank).

    Usage: ``with simulated_grid((2, 2), lines): loss = model(x)``
    """
    SimulatedGrid._active.append((grid, lines))
    try:
        yield
    finally:
        SimulatedGrid._active.pop()


def grid_comms(alone: DomainComm | None = None) -> tuple[tuple[int, ...], tuple[DomainComm, ...]]:
    """The domain grid and this rank's grid line on each of its dims (``DistributedManager``'s groups, or a simulated
    rank's inside ``simulated_grid``); with no manager, ``((1,), (alone,))`` where ``alone`` is given.

    Usage: ``grid, lines = grid_comms()``
    """
    if SimulatedGrid._active:
        return SimulatedGrid._active[-1]
    if alone is not None and not DistributedManager.is_initialized():
        return (1,), (alone,)
    dm = DistributedManager()
    grid = dm.domain_grid
    if len(grid) == 1:
        return grid, (DomainComm("domain", tuple(dm.axis_ranks("domain")), dm.axis_rank("domain"), dm.epoch),)
    names = [f"domain_{i}" for i in range(len(grid))]
    return grid, tuple(DomainComm(n, tuple(dm.axis_ranks(n)), dm.axis_rank(n), dm.epoch) for n in names)


def shard_blocks(x: torch.Tensor, dims: Sequence[int], sizes: Sequence[Sequence[int] | None] | None,
                 comm: DomainComm) -> DomainTensor:
    """This rank's block of ``x`` (held whole on every domain rank); see ``domain.shard(x, dims=...)``."""
    grid, lines = grid_comms(comm)
    dims = tuple(d % x.ndim if isinstance(d, int) and -x.ndim <= d < x.ndim else _bad_dim(d, x.ndim) for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"domain.shard: dims={dims} repeats a dim; give each sharded dim once")
    if len(dims) != len(grid):
        raise ValueError(
            f"domain.shard: dims={dims} names {len(dims)} sharded dims but the domain grid {grid} has {len(grid)} "
            f"dims; pass {len(grid)} dims (one per grid dim), or initialize the manager with a "
            f"{len(dims)}-dim grid, e.g. domain={tuple([2] * len(dims))}")
    per_dim = list(sizes) if sizes is not None else [None] * len(dims)
    if len(per_dim) != len(dims):
        raise ValueError(f"domain.shard: sizes has {len(per_dim)} entries for {len(dims)} dims; give one per dim")
    layout = tuple(split_sizes(x.shape[d], g, s) for d, g, s in zip(dims, grid, per_dim))
    spec = BlockSpec(dims, layout, lines, comm)
    local = x
    for d, start, count in zip(dims, spec.offsets, spec.local_sizes):
        if count != x.shape[d]:
            local = local.narrow(d, start, count)
    return wrap_anew(local, spec) if local is x else adopt(local.contiguous(), spec)  # contiguous, as the whole tensor


def _bad_dim(dim: object, ndim: int) -> int:
    raise ValueError(f"domain.shard: dim {dim!r} is out of range for a {ndim}-D tensor (use 0..{ndim - 1})")


def gather_whole(local: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """Every block gathered into the whole tensor on every rank (one grid dim after the other)."""
    for d, sizes, line in zip(spec.dims, spec.sizes, spec.lines):
        everything = (Span.rows(0, sum(sizes)),)
        local = gather_rows(local, d, plan_exchange(sizes, (everything,) * len(sizes), line.index), line)
    return local


def _own_block(whole: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    for d, start, count in zip(spec.dims, spec.offsets, spec.local_sizes):
        whole = whole.narrow(d, start, count)
    return whole


def block_full_tensor(x: DomainTensor) -> DomainTensor:
    """The whole tensor on every domain rank, replicated (differentiable: backward keeps this rank's block).

    Usage: ``whole = xs.full_tensor()``
    """
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    whole = linear_op(lambda t: gather_whole(t, spec), lambda g: _own_block(g, spec), unwrap(x))
    return adopt(whole, DomainSpec.replicated(spec.comm))


@plan_cache(maxsize=1024)
def halo_rows_only(sizes: tuple[int, ...], plan: WindowPlan, me: int) -> tuple[ExchangePlan, int, int]:
    """This rank's window exchange without its padding rows, and the padding (left, right) for the kernel.

    Usage: ``xplan, left, right = halo_rows_only(sizes, plan_window(sizes, 3, 1, 1, 1, 1), line.index)``

    NOTE: on blocks a padding row materialized in one pass would travel in the next (it is part of the
    extended rows): so no pass materializes any, and the kernel (or one ``F.pad`` on edge blocks) adds them.
    """
    mine = plan.needs[me]
    left = mine[0].stop if mine and mine[0].is_fill else 0
    right = mine[-1].stop if len(mine) > 1 and mine[-1].is_fill else 0
    core = tuple(span for span in mine if not span.is_fill)
    return plan_exchange(sizes, plan.needs[:me] + (core,) + plan.needs[me + 1:], me), left, right


def window_plans(spec: BlockSpec, first: int, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                 pads: list[tuple[int, int]]) -> tuple[tuple[ExchangePlan, ...], BlockSpec]:
    """This rank's exchange per block dim for a window op's input rows, halos and corners (``gather_planned``), and the
    output's layout; ``pads`` (per spatial dim, ``first`` being the first spatial tensor dim) becomes the padding the
    kernel must still add.

    Usage: ``plans, out_spec = window_plans(spec, 2, (3, 3), (1, 1), (1, 1), [(1, 1), (1, 1)])``
    """
    out_sizes, plans = [], []
    for d, sizes, line in zip(spec.dims, spec.sizes, spec.lines):
        i = d - first
        plan = plan_window(sizes, kernel[i], stride[i], dilation[i], *pads[i])
        xplan, left, right = halo_rows_only(sizes, plan, line.index)
        plans.append(xplan)
        pads[i] = (left, right)
        out_sizes.append(plan.out_sizes)
    return tuple(plans), spec.with_sizes(tuple(out_sizes))


def gather_planned(local: torch.Tensor, spec: BlockSpec, plans: tuple[ExchangePlan, ...], fill: float = 0.0,
                   passes: bool = False) -> torch.Tensor:
    """The rows ``plans`` (one ``ExchangePlan`` per block dim) bring: every neighbour's box in one round, corners
    included, or (``passes``) one pass per block dim, the second moving extended rows (corners travel).

    Usage: ``ext = gather_planned(local, spec, box_plans(spec, [needs_h, needs_w]))``

    NOTE: one round took 0.20-0.80x the time of one pass per grid dim on the 2-core CPU (docs/benchmarks.md). With
    blocks overlap on, a rank whose level declines to overlap takes a window's plain path while its grid-line peers
    post per-line messages: then it must send the same ones, one pass per dim (``passes``).
    """
    if passes:
        for d, plan, line in zip(spec.dims, plans, spec.lines):
            local = gather_rows(local, d, plan, line, fill)
        return local
    grid = tuple(len(s) for s in spec.sizes)
    return gather_box(local, spec.dims, plans, tuple(line.index for line in spec.lines), grid, spec.comm, fill)


def box_plans(spec: BlockSpec, needs: Sequence[tuple]) -> tuple[ExchangePlan, ...]:
    """This rank's exchange per block dim for rows ``needs[k]`` (one row map per rank of grid line ``k``).

    Usage: ``ext = gather_planned(local, spec, box_plans(spec, [needs_h, needs_w]))``
    """
    return tuple(plan_exchange(s, tuple(n), line.index) for s, n, line in zip(spec.sizes, needs, spec.lines))


def gather_along(local: torch.Tensor, spec: BlockSpec, axis: int, needs: tuple, fill: float = 0.0) -> torch.Tensor:
    """Rows ``needs`` (one row map per rank of the grid line) of block dim ``axis``, from their owners.

    Usage: ``ext = gather_along(local, spec, 0, needs)``
    """
    line = spec.lines[axis]
    return gather_rows(local, spec.dims[axis], plan_exchange(spec.sizes[axis], needs, line.index), line, fill)


def in_layout(x: DomainTensor, spec: BlockSpec) -> torch.Tensor:
    """``x``'s local block in the layout of ``spec`` (same dims): rows move along each grid dim whose sizes differ.

    Usage: ``local = in_layout(skip, ref.spec)  # a U-Net skip laid out like the upsampled tensor``
    """
    have = x._spec
    assert isinstance(have, BlockSpec)
    if have.dims != spec.dims or [sum(s) for s in have.sizes] != [sum(s) for s in spec.sizes]:
        raise ValueError(f"block tensors of different global shapes or block dims ({have.dims}, {have.sizes} vs "
                         f"{spec.dims}, {spec.sizes}) cannot be combined; shard them alike")
    local = unwrap(x)
    for axis, needs in layout_gathers(have, spec):
        local = gather_along(local, have, axis, needs)
    return local


def layout_gathers(have: BlockSpec, want: BlockSpec, skip: int | None = None) -> tuple[tuple[int, tuple], ...]:
    """``(axis, needs)`` per grid axis (but ``skip``) whose sizes differ: the gathers along grid lines that lay a block
    of ``have`` out as ``want`` (the same dims and global lengths), for ``gather_along`` or ``step.LineRows``.

    Usage: ``LineRows(skip_tensor, layout_gathers(skip_tensor.spec, ref.spec))``
    """
    return tuple((axis, block_needs(w)) for axis, (mine, w) in enumerate(zip(have.sizes, want.sizes))
                 if axis != skip and mine != w)


def replicate_blocks_if_singleton(x: DomainTensor) -> DomainTensor:
    """``x`` replicated when every block dim has global length 1 (global pooling before a head), else ``x``.

    Usage: ``pooled = replicate_blocks_if_singleton(adopt(local, spec))``
    """
    spec = x._spec
    assert isinstance(spec, BlockSpec)
    return block_full_tensor(x) if all(sum(s) == 1 for s in spec.sizes) else x
