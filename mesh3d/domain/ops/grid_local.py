"""Rules run on each rank's block or tokens as they are, written once for blocks and token grids: transpose and
permute (the sharded dims move with their dims), ``view_as`` onto a tensor laid out alike, and Linear, chunk, split
and unbind along a dim that is not sharded. Each plans its step from metadata alone (kept per signature,
``dispatch.kept``).

Usage: ``for f, rule in local_rules(LocalGrid(spec_of, checked, moved, "blocks")).items(): TABLE.register(f, rule)``
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mesh3d._torch_private import linear_not_a_view
from mesh3d.domain.core.tensor import DomainTensor, size_of
from mesh3d.domain.dispatch.kept_steps import metadata_rule
from mesh3d.domain.dispatch.step import Step, whole_operand

__all__ = ["LocalGrid", "local_rules"]


@dataclass(frozen=True)
class LocalGrid:
    """How one grid layout answers the local rules: ``spec_of(x)``, its spec where a view may take it;
    ``checked(op, x, dims)``, its spec where ``op`` acting along ``dims`` is local, else a refusal naming ``op``;
    ``moved(spec, new_position)``, the spec after its dims moved (``new_position(old dim)``); ``name`` for errors."""

    spec_of: Callable[[DomainTensor], Any]
    checked: Callable[[str, DomainTensor, list], Any]
    moved: Callable[[Any, Callable[[int], int]], Any]
    name: str


def local_rules(grid: LocalGrid) -> dict[Callable, Callable]:
    """{torch function: its rule} for the layout ``grid`` describes (module docstring)."""

    @metadata_rule()
    def transpose(input, dim0, dim1) -> Step:
        d0, d1 = dim0 % input.ndim, dim1 % input.ndim
        swap = {d0: d1, d1: d0}
        return Step(lambda t: torch.transpose(t, d0, d1), (input,),
                    out=grid.moved(grid.spec_of(input), lambda d: swap.get(d, d)))

    @metadata_rule()
    def permute(input, *dims) -> Step:
        given = dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
        order = tuple(d % input.ndim for d in given)
        return Step(lambda t: t.permute(order), (input,), out=grid.moved(grid.spec_of(input), order.index))

    @metadata_rule()
    def view_as(input, other) -> Step:
        # NOTE: FSDP2 calls ``x.view_as(x)`` on every forward input to hook its backward: exact on an identically
        # laid out tensor of the same shape; anything else would reinterpret rows across blocks or tokens.
        if isinstance(input, DomainTensor) and isinstance(other, DomainTensor) and input._spec == other._spec \
                and size_of(input) == size_of(other):
            return Step(lambda t, o: t.view_as(o), (input, other), out=grid.spec_of(input))
        raise NotImplementedError(f"torch.Tensor.view_as on {grid.name}: only onto an identically laid out tensor of "
                                  "the same shape; call .full_tensor() first")

    @metadata_rule()
    def linear(input, weight, bias=None) -> Step:
        op = "torch.nn.functional.linear"
        spec = grid.checked(op, input, [-1])  # NOTE: checked before the local product
        return Step(linear_not_a_view, (input, whole_operand(weight, op), whole_operand(bias, op)), out=spec)

    @metadata_rule()
    def unbind(input, dim=0) -> Step:
        spec = grid.checked("torch.unbind", input, [dim])
        d = dim % input.ndim
        return Step(lambda t: torch.unbind(t, d), (input,), out=grid.moved(spec, lambda b: b - (d < b)))

    def splitter(func: Callable, name: str) -> Callable:
        @metadata_rule()
        def rule(input, split_size_or_sections, dim=0) -> Step:
            spec = grid.checked(name, input, [dim])
            return Step(lambda t: func(t, split_size_or_sections, dim), (input,), out=spec)
        return rule

    chunk, split = splitter(torch.chunk, "torch.chunk"), splitter(torch.split, "torch.split")
    return {torch.transpose: transpose, torch.Tensor.transpose: transpose, torch.swapaxes: transpose,
            torch.Tensor.swapaxes: transpose, torch.permute: permute, torch.Tensor.permute: permute,
            torch.Tensor.view_as: view_as, F.linear: linear, torch.unbind: unbind, torch.Tensor.unbind: unbind,
            torch.chunk: chunk, torch.Tensor.chunk: chunk, torch.split: split, torch.Tensor.split: split}
