"""What an op rule returns: the inputs it needs, in which layout, the local function, the output layout.

Usage (a rule, see docs/domain.md "Adding an op rule")::

    @register(F.conv2d)
    def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> Step:
        plan = plan_window(input.spec.sizes, k, s, d, p, p)
        return Step(lambda ext: F.conv2d(ext.tensor, weight, bias, stride, ext.padding(...)),
                    (Window(input, plan),), out=input.spec.with_sizes(plan.out_sizes))

A rule only *declares*: it never communicates and never wraps. The dispatcher
(``mesh3d.domain.dispatch``) resolves each requirement in ``args`` (halo rows, a row map, a
layout, a replicated value entering the shards), calls ``compute`` on plain local tensors and
wraps tensor results with ``out``. Rules that combine partial results across ranks (reductions,
norm statistics) call ``mesh3d.domain.collectives`` inside ``compute``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mesh3d.domain.halo import WindowPlan
from mesh3d.domain.rows import RowMap
from mesh3d.domain.tensor import DomainSpec, DomainTensor

__all__ = ["Entering", "Extended", "Layout", "Rows", "Step", "Window"]


@dataclass(frozen=True)
class Window:
    """A window op's input rows (``plan``): resolved to ``Extended``; the local kernel pads symmetrically.

    ``kernel_pads=False`` when the local function cannot take padding on the sharded dim (then
    every fill row is materialized). ``overlap=(extent, stride)`` of the window along the sharded dim
    declares that the local function may be called on row strips of the input (each with no padding
    on the sharded dim, results concatenated): the dispatcher then computes the interior while the
    halo rows travel (``mesh3d.domain.overlap``).
    """

    x: DomainTensor
    plan: WindowPlan
    fill: float = 0.0
    kernel_pads: bool = True
    overlap: tuple[int, int] | None = None


@dataclass(frozen=True)
class Extended:
    """``tensor``: this rank's input rows for a window op; ``pad``: the padding the kernel must add on both
    sides of the sharded dim (the remaining padding rows are already in ``tensor``)."""

    tensor: torch.Tensor
    pad: int


@dataclass(frozen=True)
class Rows:
    """Any rows of ``x`` (a ``RowMap`` per rank), gathered from their owners: resolved to a plain tensor."""

    x: DomainTensor
    needs: tuple[RowMap, ...]
    fill: float = 0.0


@dataclass(frozen=True)
class Layout:
    """``x``'s local tensor in the layout ``sizes`` (moved there if it is laid out otherwise)."""

    x: DomainTensor
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Entering:
    """A replicated value used by every shard: its gradient is summed over the domain on the way back."""

    x: DomainTensor


@dataclass(frozen=True)
class Step:
    """A rule's declaration: ``compute(*resolved args, **kwargs)`` on local tensors, results laid out as ``out``.

    ``out_ndim``: only tensor results of this rank are wrapped (others pass through plain).
    ``keep``: plain tensors the caller may still hold, wrapped as views rather than re-classed.
    """

    compute: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    out: DomainSpec | None = None
    out_ndim: int | None = None
    keep: tuple = ()
