"""The sharded layouts, each one registered object: its rule table, its rank among the layouts met in one call, what
the op journal records of a call, its refusal, whether its rules trace, and its ``full_tensor``.

Usage::

    entry = LAYOUTS.of(xs.spec.layout)          # a RegisteredLayout (None for a replicated tensor)
    rule = entry.rules.get(torch.Tensor.sum)
    for entry in LAYOUTS: ...                   # every registered layout, slabs first

Adding a layout is a ``Layout`` member and its spec (``core.specs``), its rules (a ``RuleTable`` the ops register
into), and one ``LAYOUTS.register(RegisteredLayout(...))``. From there the dispatcher picks and runs its rules, the
operator cases (``dispatch.operators``) look its table up, ``full_tensor`` gathers it, and the tests that walk every
layout (the custom rules' factories, the layout sweep) find it missing until they cover it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mesh3d.domain.core.specs import Layout
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.registry import BLOCK_RULES, GRAPH_RULES, RULES, STRIDED_RULES, TOKEN_RULES, RuleTable
from mesh3d.domain.layouts.blocks import block_full_tensor
from mesh3d.domain.layouts.graph import graph_full_tensor
from mesh3d.domain.layouts.slabs import full_tensor as slab_full_tensor
from mesh3d.domain.layouts.tokens import token_full_tensor

__all__ = ["LAYOUTS", "LayoutRegistry", "RegisteredLayout"]


@dataclass(frozen=True)
class RegisteredLayout:
    """One sharded layout as the dispatcher sees it.

    ``priority``: where inputs of several layouts meet in one call, the highest picks the rule table (a graph's
    rules know grids and slabs, a grid's know slabs); of equal ones, the first argument's.
    ``journal``: what the op journal records of a call before its rule runs (the spec's global facts), or None to
    record only a step that moves rows or changes the layout, after it ran (slabs: most ops move nothing).
    ``refusal``: the message for an op without a rule, from its name and the spec.
    ``traceable``: whether Dynamo can inline the rules (the storage subclass's compile). A graph's rules plan halos in
    numpy: there each op is a graph break. Wrapper tensors' rules run on fake shards, graphs' too; one that must read
    values raises ``NotImplementedError`` there, and Dynamo breaks the graph before it.
    """

    layout: Layout
    name: str
    priority: int
    rules: RuleTable
    refusal: Callable[[str, Any], str]
    full_tensor: Callable[[DomainTensor], DomainTensor]
    journal: Callable[[Any], tuple] | None = None
    traceable: bool = True


class LayoutRegistry:
    """Every registered layout, by its ``Layout``.

    Usage: ``LAYOUTS.register(RegisteredLayout(...))``, ``LAYOUTS.of(spec.layout)``, ``LAYOUTS.tables()``
    """

    def __init__(self) -> None:
        self._by_layout: dict[Layout, RegisteredLayout] = {}
        self._tables: tuple[RuleTable, ...] = ()
        self.priority: dict[Layout, int] = {Layout.REPLICATED: 0}  # NOTE: read per argument by the dispatcher's scan

    def register(self, entry: RegisteredLayout) -> None:
        if entry.layout in self._by_layout:
            raise ValueError(f"the layout {entry.layout} is registered already (as {self._by_layout[entry.layout].name!r})")
        if entry.priority <= 0:
            raise ValueError(f"layout {entry.name!r}: priority {entry.priority} must be positive (0 is a replicated "
                             "tensor's, which never picks the rules)")
        self._by_layout[entry.layout] = entry
        self.priority[entry.layout] = entry.priority
        self._tables = tuple(e.rules for e in self._by_layout.values())

    def of(self, layout: Layout) -> RegisteredLayout | None:
        return self._by_layout.get(layout)

    def tables(self) -> tuple[RuleTable, ...]:
        """Every registered layout's rule table, slabs first."""
        return self._tables

    def __iter__(self) -> Iterator[RegisteredLayout]:
        return iter(tuple(self._by_layout.values()))

    def __len__(self) -> int:
        return len(self._by_layout)


LAYOUTS = LayoutRegistry()


def _slab_refusal(name: str, spec: Any) -> str:
    return (f"{name} has no domain rule: mesh3d will not run it on a domain-sharded tensor (sharded dim {spec.dim}) "
            "because the local answer could differ from the one-process answer. Call .full_tensor() first, or "
            "register a rule with mesh3d.domain.register (docs/domain.md, 'Adding an op rule')")


def _strided_refusal(name: str, spec: Any) -> str:
    return (f"{name} has no rule for a strided layout (a sharded dim merged under the dims before it, as "
            "x.view(-1, c) of a (B, T, c) tensor sharded along T makes): reshape it back to the unstrided shape first "
            "(x.view(B, T, c)), or call .full_tensor()")


def _grid_refusal(what: str) -> Callable[[str, Any], str]:
    def refusal(name: str, spec: Any) -> str:
        return (f"{name} has no rule for {what} sharded over dims {spec.dims} on a domain grid): mesh3d will not run "
                "it, because the local answer could differ from the one-process answer. The ops supported are listed "
                "in docs/domain.md, 'Blocks' and 'Token grids'. Call .full_tensor() first, or move to slabs with "
                "domain.redistribute(x, dim=...)")
    return refusal


def _graph_refusal(name: str, spec: Any) -> str:
    hint = _GRAPH_HINTS.get(name.rsplit(".", 1)[-1], "")
    return (f"{name} has no rule for graph layouts (nodes or edges split by a partition, along dim {spec.dim}): "
            f"mesh3d will not run it, because the local answer could differ from the one-process answer.{hint} The "
            "ops supported are listed in docs/domain.md, 'Graphs and meshes'. Call .full_tensor() first, or register a "
            "rule with mesh3d.domain.register")


_CSR = (" Each rank holds the edges into its own nodes already: aggregate at the destinations with index_add_ or "
        "scatter_reduce (exact, no sorting) instead of building CSR.")
#: What graph code reaches for instead, by the refused op's name (an outside hunt's refusals, issue 65)
_GRAPH_HINTS = {
    "argsort": _CSR, "sort": _CSR,
    "flip": " To reverse the edges, take the rows by name: src, dst = edge_index, then use dst where src was.",
    "index_reduce_": " scatter_reduce_ (with the index expanded to the values' shape) has rules for every reduction at the destinations.",
    "index_reduce": " scatter_reduce (with the index expanded to the values' shape) has rules for every reduction at the destinations.",
}


def _grid_journal(spec: Any) -> tuple:
    return spec.dims, tuple(sum(s) for s in spec.sizes)


def _graph_journal(spec: Any) -> tuple:
    return (spec.dim,), (spec.items.n,)


LAYOUTS.register(RegisteredLayout(Layout.SLAB, "slabs", 1, RULES, _slab_refusal, slab_full_tensor))
LAYOUTS.register(RegisteredLayout(Layout.STRIDED, "strided slabs", 2, STRIDED_RULES, _strided_refusal,
                                  slab_full_tensor))
LAYOUTS.register(RegisteredLayout(Layout.BLOCKS, "blocks", 3, BLOCK_RULES,
                                  _grid_refusal("block layouts (a domain tensor"), block_full_tensor, _grid_journal))
LAYOUTS.register(RegisteredLayout(Layout.TOKENS, "token grids", 3, TOKEN_RULES,
                                  _grid_refusal("token grids (blocks flattened into tokens"), token_full_tensor,
                                  _grid_journal))
LAYOUTS.register(RegisteredLayout(Layout.GRAPH, "graphs", 4, GRAPH_RULES, _graph_refusal, graph_full_tensor,
                                  _graph_journal, traceable=False))
