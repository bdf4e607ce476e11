"""The layout of a domain tensor: one declared type (``LayoutSpec``) whose ``layout`` says which of the three it is.

Usage::

    spec = xs.spec
    if spec.layout is Layout.BLOCKS: ...          # never ``hasattr(spec, "dims")``
    spec.sharded_dims, spec.comm                   # every layout answers both

* ``DomainSpec``: a *slab* (one sharded dim, any per-rank sizes), a *strided* slab (``outer > 1``), or a value
  *replicated* over the domain (``dim=None``: results of global reductions);
* ``BlockSpec``: *blocks*, one sharded dim per dim of a factored domain grid;
* ``TokenSpec``: a *token grid*, blocks flattened into one token dim with the global token order kept;
* ``GraphSpec``: the nodes (or edges) of a graph, split by a partition of any assignment (``mesh3d.graphs``).

The dispatcher picks an op's rule table by ``layout`` (``mesh3d.domain.dispatch.registry``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_dynamo_compiling

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.plan_cache import plan_property
from mesh3d.domain.core.split import offsets_of

if TYPE_CHECKING:
    from mesh3d.graphs import Graph, Partition

__all__ = ["AnySpec", "BlockSpec", "DomainSpec", "GraphSpec", "Layout", "LayoutSpec", "TokenSpec", "grid_coords",
           "sharded_dims"]


class Layout(enum.Enum):
    """How a domain tensor is laid out over the domain ranks.

    Usage: ``if xs.spec.layout is domain.Layout.BLOCKS: ...``
    """

    REPLICATED = "replicated"  #: every domain rank holds the whole value
    SLAB = "slab"              #: one sharded dim
    STRIDED = "strided"        #: a slab merged under the dims before it (``x.view(-1, c)``)
    BLOCKS = "blocks"          #: one sharded dim per grid dim
    TOKENS = "tokens"          #: blocks flattened into one token dim
    GRAPH = "graph"            #: a graph's nodes or edges, split by a partition of any assignment


class LayoutSpec:
    """What every domain tensor's spec declares: its ``layout``, the dims it shards, and its domain group ``comm``.

    Usage: ``spec.layout is Layout.SLAB``, ``spec.sharded_dims``
    """

    __slots__ = ()
    comm: DomainComm

    @property
    def layout(self) -> Layout:
        raise NotImplementedError

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        """The tensor dims this layout shards (() when replicated)."""
        raise NotImplementedError


@dataclass(frozen=True)
class DomainSpec(LayoutSpec):
    """Sharded dim (None: replicated), per-rank sizes along it, and the domain group.

    Usage: ``xs.spec.dim, xs.spec.sizes, xs.spec.offset``

    ``outer > 1``: a *strided* layout (DTensor's ``_StridedShard``): the sharded dim holds ``outer`` blocks of
    ``sum(sizes)`` rows one after the other (a reshape merged the dims before it in, as ``x.view(-1, c)`` of a
    ``(B, T, c)`` tensor sharded along T does), and this rank holds its ``sizes[index]`` rows of each block, block
    by block. Its rules are ``mesh3d.domain.ops.strided``'s.
    """

    dim: int | None
    sizes: tuple[int, ...] | None
    comm: DomainComm
    outer: int = 1

    @property
    def layout(self) -> Layout:
        if self.dim is None:
            return Layout.REPLICATED
        return Layout.STRIDED if self.outer > 1 else Layout.SLAB

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        return () if self.dim is None else (self.dim,)

    @plan_property
    def offset(self) -> int:
        return offsets_of(self.sizes)[self.comm.index] if self.sizes else 0

    def __hash__(self) -> int:
        # NOTE: kept once computed: a kept call's signature (``dispatch.kept``) hashes its specs on every call (0.36 us
        # each). Not pickled (``__getstate__``: a string's hash differs between processes); traced, computed afresh
        if is_dynamo_compiling():
            return hash((self.dim, self.sizes, self.comm, self.outer))
        known = self.__dict__.get("_hash")
        if known is None:
            known = self.__dict__["_hash"] = hash((self.dim, self.sizes, self.comm, self.outer))
        return known

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @staticmethod
    def replicated(comm: DomainComm) -> DomainSpec:
        """The spec of a value every rank of ``comm`` holds whole: a full reduction, a gathered tensor.

        NOTE: every field given. A spec made inside a compiled graph is rebuilt after the graph field by field, and
        torch 2.11 reads a defaulted field through ``dataclasses.fields`` wrapped in ``torch._dynamo.disable``:
        4.4 us per call on this CPU, on every compiled step that returns a replicated loss."""
        return DomainSpec(None, None, comm, 1)

    def with_sizes(self, sizes: tuple[int, ...], dim: int | None = None) -> DomainSpec:
        """The same group with other sizes (and dim); this spec itself when nothing changes."""
        dim = self.dim if dim is None else dim
        if dim == self.dim and sizes == self.sizes:
            return self
        return DomainSpec(dim, tuple(sizes), self.comm, self.outer)


@dataclass(frozen=True)
class BlockSpec(LayoutSpec):
    """Sharded ``dims`` (one per grid dim), every grid line's sizes along each, this rank's grid lines, the domain.

    Usage: ``xs.spec.dims, xs.spec.sizes[0], xs.spec.offsets``
    """

    dims: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    lines: tuple[DomainComm, ...]
    comm: DomainComm

    layout = Layout.BLOCKS  # a constant of the class

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        return self.dims

    @plan_property
    def offsets(self) -> tuple[int, ...]:
        """This rank's global start along each sharded dim."""
        return tuple(offsets_of(s)[line.index] for s, line in zip(self.sizes, self.lines))

    @plan_property
    def local_sizes(self) -> tuple[int, ...]:
        return tuple(s[line.index] for s, line in zip(self.sizes, self.lines))

    def with_sizes(self, sizes: tuple[tuple[int, ...], ...]) -> BlockSpec:
        return self if sizes == self.sizes else BlockSpec(self.dims, tuple(map(tuple, sizes)), self.lines, self.comm)

    @property
    def dim(self) -> int:
        # NOTE: a safety net: code written for slabs reads ``spec.dim``; on blocks it must refuse, not guess.
        raise NotImplementedError(
            f"this operation supports slabs (one sharded dim) only; the tensor is sharded in blocks over dims "
            f"{self.dims}. Gather it with .full_tensor(), or use the ops listed in docs/domain.md 'Blocks'")

    def global_shape(self, local_shape: Sequence[int]) -> torch.Size:
        shape = list(local_shape)
        for d, s in zip(self.dims, self.sizes):
            shape[d] = sum(s)
        return torch.Size(shape)


@dataclass(frozen=True)
class TokenSpec(LayoutSpec):
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

    layout = Layout.TOKENS  # a constant of the class

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        """The sharded tensor dims (the token dim)."""
        return (self.token_dim,)

    @property
    def dims(self) -> tuple[int, ...]:
        """The sharded tensor dims (the token dim), as blocks name them."""
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


@dataclass(frozen=True)
class GraphSpec(LayoutSpec):
    """Items of a graph (nodes, or edges) along ``dim``, split by the partition ``items`` (any assignment; each rank
    holds its items in ascending global order), over the domain ``comm``. ``graph``: the ``mesh3d.graphs.Graph`` whose
    edges these are, or whose node ids an integer tensor holds (None for plain node tensors); ``endpoint``: such an
    index tensor's values are row ``endpoint`` of the graph's edge list (0 sources, 1 destinations; -1: the ``(2, E)``
    edge list itself, its dim 0 the two rows).

    Usage: ``xs.spec.items.counts, xs.spec.dim, ei.spec.graph.halo_counts(xs.spec.items)``
    """

    dim: int
    items: Partition
    comm: DomainComm
    graph: Graph | None = None
    endpoint: int | None = None

    layout = Layout.GRAPH  # a constant of the class
    outer = 1  # never strided: generic code reading ``sum(sizes) * outer`` gets the item count

    @property
    def sizes(self) -> tuple[int, ...]:
        """Items held by each domain rank."""
        return self.items.counts

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        return (self.dim,)

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.dim,)

    def replaced(self, **changes: Any) -> GraphSpec:
        """This spec with fields changed (itself when nothing changes).

        Usage: ``spec.replaced(dim=1, endpoint=None)``
        """
        if all(getattr(self, k) is v for k, v in changes.items()):
            return self
        return replace(self, **changes)

    def global_shape(self, local_shape: Sequence[int]) -> torch.Size:
        shape = list(local_shape)
        shape[self.dim] = self.items.n
        return torch.Size(shape)


def grid_coords(index: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    """A domain rank's grid coordinates (the grid is the domain axis unflattened, row-major).

    Usage: ``grid_coords(3, (2, 2))  # (1, 1)``
    """
    out = []
    for g in reversed(grid):
        out.append(index % g)
        index //= g
    return tuple(reversed(out))


def sharded_dims(spec: LayoutSpec) -> tuple[int, ...]:
    """The dims a domain spec shards: a slab's dim, the block dims, a token grid's token dim; () when replicated.

    Usage: ``if sharded_dims(x._spec): ...  # any layout, never reading a blocks spec's .dim``
    """
    return spec.sharded_dims


#: The spec of any domain tensor (what ``DomainTensor.spec`` is): read its ``layout`` before a layout's own fields.
AnySpec = DomainSpec | BlockSpec | TokenSpec | GraphSpec
