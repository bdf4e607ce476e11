"""What an op rule returns: the inputs it needs, in which layout, the local function, the output layout.

Usage (a rule, see docs/domain.md "Adding an op rule")::

    @register(F.conv2d)
    def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Step:
        plan = plan_window(input.spec.sizes, k, s, d, p, p)
        return Step(lambda ext: F.conv2d(ext.tensor, weight, bias, stride, ext.padding(...)),
                    (Window(input, plan),), out=input.spec.with_sizes(plan.out_sizes))

A rule only *declares*: it never communicates and never wraps. The dispatcher
(``mesh3d.domain.dispatch.dispatcher``) resolves each requirement in ``args`` (halo rows, a row map, a
layout, a replicated value entering the shards), calls ``compute`` on plain local tensors and
wraps tensor results with ``out``. A step whose local results are each rank's part of the one-process value (a sum
over the sharded dim) declares it (``partial=Partial("sum", then)``): the executor combines the parts over the domain,
then ``then`` finishes the value. A statistic ``compute`` uses before its result (a variance's mean, a softmax's maximum
and sum, a maximum's ties, a norm's moments) is combined by a function the executor hands it (``Combining``).
Attention's modes send their messages inside ``compute`` (the ring interleaves them with its blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


from mesh3d.domain.comm.rows import ExchangePlan, RowMap
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor

__all__ = ["AllTokens", "Boxes", "Combining", "Entering", "LineRows", "Moved", "Narrowed", "OwnRows", "Partial",
           "Pencils", "PrefixTokens", "Reached", "Relaid", "Resplit", "Rows", "Step", "Whole", "whole_operand",
           "whole_operands"]


@dataclass(frozen=True)
class Rows:
    """Any rows of ``x`` (a ``RowMap`` per rank), gathered from their owners: resolved to a plain tensor.

    Usage: ``Step(compute, (Rows(x, needs),), out=x.spec)  # needs[r]: the runs of global rows rank r reads``
    """

    x: DomainTensor
    needs: tuple[RowMap, ...]
    fill: float = 0.0


@dataclass(frozen=True)
class Reached:
    """Rows ``first`` to ``last`` of ``x`` along its sharded dim (none where ``last < first``): what this rank's data
    reaches (a sampling grid's extent), so its peers cannot know it from metadata: the executor tells them (one
    all-reduce of every rank's pair), then gathers as for ``Rows``. Resolved to a plain tensor from row ``first``.

    Usage: ``Step(compute, (Reached(xs, lo, hi), grid), out=grid.spec)``
    """

    x: DomainTensor
    first: int
    last: int


@dataclass(frozen=True)
class Resplit:
    """``x``'s local tensor re-split to the per-rank ``sizes`` along its sharded dim (rows move only if they differ).

    Usage: ``Step(torch.add, (a, Resplit(b, a.spec.sizes)), out=a.spec)``
    """

    x: DomainTensor
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Moved:
    """``x``'s local tensor with the sharding moved to ``dim`` (``sizes`` along it), its own sharded dim whole: an
    all-to-all the executor runs, differentiable.

    Usage: ``Step(torch.fft.fft2, (Moved(xs, 1, (2, 2)),), out=xs.spec, laid_out_as=DomainSpec(1, (2, 2), comm))``
    """

    x: DomainTensor
    dim: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class LineRows:
    """Rows of a block tensor ``x`` gathered along its grid lines, one block dim after the other: for each ``(axis,
    needs)`` in order, ``needs[r]`` (a ``RowMap``) the rows of block dim ``axis`` that rank ``r`` of that grid line
    reads; resolved to a plain tensor.

    Usage: ``Step(lambda t: torch.flip(t, dims), (LineRows(xs, ((1, mirrored_rows(sizes)),)),), out=xs.spec)``
    """

    x: DomainTensor
    gathers: tuple[tuple[int, tuple[RowMap, ...]], ...]


@dataclass(frozen=True)
class Boxes:
    """Rows of a block tensor ``x`` along every block dim, ``plans[k]`` (an ``ExchangePlan`` on grid line ``k``:
    ``layouts.blocks.box_plans`` or ``window_plans``), every neighbour's box in one round with its corners, or one pass
    per block dim (``passes``); ``fill`` for rows outside the whole. Resolved to a plain tensor.

    Usage: ``Step(conv, (Boxes(xs, window_plans(spec, 2, k, s, d, pads)[0]),), out=out_spec)``
    """

    x: DomainTensor
    plans: tuple[ExchangePlan, ...]
    fill: float = 0.0
    passes: bool = False


@dataclass(frozen=True)
class Pencils:
    """Rows moved along grid lines of blocks, one all-to-all per move, in order: ``(line, src_dim, src_sizes, dst_dim,
    dst_sizes)`` makes ``src_dim`` whole on that grid line and splits ``dst_dim`` as ``dst_sizes`` (a pencil
    decomposition); differentiable. As an argument: ``x``'s local tensor so moved. As a step's ``laid_out_as`` (``x``
    None): the step's results are so moved before they are wrapped (the way back).

    Usage: ``Step(fft, (Pencils(xs, there),), out=spec, laid_out_as=Pencils(None, back))``
    """

    x: DomainTensor | None
    moves: tuple[tuple[DomainComm, int, tuple[int, ...], int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Relaid:
    """``x``'s local tensor moved between slabs and blocks as ``domain.redistribute(x, dim=, dims=, sizes=)`` moves it
    (``layouts.relayout.relayout``: slabs to blocks, blocks to slabs along one of their dims, blocks to other sizes or
    dims), differentiable.

    Usage: ``Step(torch.add, (a, Relaid(b, None, a.spec.dims, a.spec.sizes)), out=a.spec)``
    """

    x: DomainTensor
    dim: int | None
    dims: tuple[int, ...] | None
    sizes: Any = None


@dataclass(frozen=True)
class AllTokens:
    """Every rank's tokens of a token grid ``x``, in domain rank order (``spec.gathered_index`` gives their global
    indices): the keys of attention scores; the gradient of each rank's use goes back to the owners.

    Usage: ``Step(torch.matmul, (q, AllTokens(kt)), out=q.spec.with_keys(kt.spec, None))``
    """

    x: DomainTensor


@dataclass(frozen=True)
class PrefixTokens:
    """Global tokens ``start`` to ``stop`` (prefix tokens: class or register tokens, held by domain rank 0) of a token
    grid ``x`` on every rank, a replicated value (its gradient kept once, by rank 0).

    Usage: ``Step(lambda t: t.select(1, 0), (PrefixTokens(t, 0, 1),), out=DomainSpec.replicated(comm))``
    """

    x: DomainTensor
    start: int
    stop: int


@dataclass(frozen=True)
class Whole:
    """``x``'s whole tensor on every rank, as ``x.full_tensor()`` gives it (its gradient keeps this rank's part).

    Usage: ``Step(lambda t: t.select(2, row), (Whole(xs),), out=DomainSpec.replicated(comm))``
    """

    x: DomainTensor


@dataclass(frozen=True)
class Entering:
    """A replicated value used by every shard: its gradient is summed over the domain on the way back.

    Usage: ``Step(torch.mul, (xs, Entering(scale)), out=xs.spec)``
    """

    x: DomainTensor


def whole_operand(t: Any, op: str) -> Any:
    """An operand every shard uses whole (a weight, a bias) as a step takes it: a plain tensor or other value as it is;
    a replicated domain tensor as ``Entering``; a sharded one refused by name (its shard is not the whole).

    Usage: ``Step(F.linear, (xs, whole_operand(w, "F.linear"), whole_operand(b, "F.linear")), out=xs.spec)``
    """
    if not isinstance(t, DomainTensor):
        return t
    spec = t._spec
    if type(spec) is not DomainSpec or spec.dim is not None:
        raise NotImplementedError(f"{op}: a weight, bias or running statistic sharded over the domain ({spec}); every "
                                  "shard needs the whole of it: pass a plain tensor (the module's own), or "
                                  ".full_tensor() of it")
    return Entering(t)


def whole_operands(op: str, *params: Any) -> tuple:
    """``whole_operand`` of each of ``params`` (a norm's weight, bias and running statistics).

    Usage: ``Step(norm, (xs, *whole_operands("F.group_norm", weight, bias), Combining(comm)), out=xs.spec)``
    """
    return tuple(whole_operand(p, op) for p in params)


@dataclass(frozen=True)
class OwnRows:
    """This rank's rows of ``x``, a plain or replicated tensor of the global length along ``dim``, cut as ``spec``'s
    sharded dim is cut (``layouts.slabs.strided_rows``); a replicated ``x`` enters every shard as ``Entering`` does.

    Usage: ``Step(torch.add, (xs, OwnRows(pos_embed, 1, xs.spec)), out=xs.spec)``
    """

    x: Any
    dim: int
    spec: DomainSpec


@dataclass(frozen=True)
class Narrowed:
    """``x``, a plain or replicated tensor, narrowed along each ``(dim, start, length)`` of ``cuts``: this block's part
    of a whole operand; a replicated ``x`` enters every shard as ``Entering`` does.

    Usage: ``Step(torch.add, (xs, Narrowed(bias_field, ((2, 4, 3), (3, 0, 5)))), out=xs.spec)``
    """

    x: Any
    cuts: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Combining:
    """Resolved to ``combine(part, how="sum", for_shards=False, grad=True)``: ``part``, this rank's part of a value,
    combined over ``comm`` as ``Partial`` combines a step's results (``"sum"`` in rank order, the same bits on every
    rank; ``"max"`` of values with no gradient; ``"parts"``: every rank's part stacked in rank order, with no gradient,
    for a combination a sum cannot express; ``"enter"``: a replicated value as it is, its gradient summed over the
    domain (each rank's shard uses it its own way); ``for_shards``: each rank uses the value its own way, so the gradients
    of its uses are summed over the domain on the way back; ``grad=False``: no autograd node, for an autograd
    Function's own forward and backward). For statistics ``compute`` uses before its result: the executor combines
    them, the rule never talks.

    Usage: ``Step(lambda t, combine: t - combine(t.sum(2, keepdim=True), for_shards=True) / n, (xs, Combining(comm)),
    out=xs.spec)``
    """

    comm: DomainComm


@dataclass(frozen=True)
class Partial:
    """A step's results are partial: each rank's is its part of the one-process value, which the executor makes by
    combining the parts over the domain (``"sum"``, or ``"max"`` of values with no gradient), in rank order, so every
    rank holds the same bits; ``then`` (a function of the combined value: a mean's division, a rounding) finishes it.
    A sum's gradient reaches each rank's part unchanged, as every rank uses the value alike; ``for_shards``: each rank
    uses it its own way (its rows of a whole), so the gradients of its uses are summed over the domain on the way back.
    ``over``: the ranks that combine (one grid line of blocks, ``spec.lines[k]``); the domain of ``out`` by default.

    Usage: ``Step(lambda t: t.sum(dtype=torch.float64), (xs,), out=DomainSpec.replicated(comm), partial=Partial())``
    """

    combine: str = "sum"
    then: Callable[[Any], Any] | None = None
    for_shards: bool = False
    over: DomainComm | None = None

    def __post_init__(self) -> None:
        if self.combine not in ("sum", "max"):
            raise ValueError(f"Partial(combine={self.combine!r}): combine is 'sum' or 'max'")


@dataclass(frozen=True)
class Step:
    """A rule's declaration: ``compute(*resolved args, **kwargs)`` on local tensors, results laid out as ``out``.

    ``out_ndim``: only tensor results of this rank are wrapped (others pass through plain).
    ``keep``: plain tensors the caller may still hold, wrapped as views rather than re-classed.
    ``partial``: the results are each rank's part of a replicated ``out`` (``Partial``), combined before wrapping.
    ``laid_out_as``: the results are sharded as this spec says (a dim ``Moved`` there): the executor moves them to
    ``out``'s dim and sizes (an all-to-all) before wrapping.

    Usage: ``return Step(torch.relu, (xs,), out=xs.spec)`` from a rule (``domain.register``)
    """

    compute: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    out: DomainSpec | None = None
    out_ndim: int | None = None
    keep: tuple = ()
    partial: Partial | None = None
    laid_out_as: DomainSpec | None = None
