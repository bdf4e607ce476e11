"""Where a simulated step crosses the blocks of a repeated layer stack: marks that cut its record into pieces.

A model built as ``n`` identical blocks (``nn.ModuleList``/``nn.Sequential``) runs the same ops on the same
shapes in every block, so its step is a prefix, the first block's forward, ``n - 2`` alike forwards, a tail (the
last block, the head and the loss forward, then back to the last block's gradients), ``n - 2`` alike backwards, the
first block's backward and an end. ``BlockMarks`` cuts one simulated step there: a mark at each block's forward
pre-hook, and one as the gradient of each block's output arrives (before FSDP's pre-backward, whose prefetch of the
block below then falls in the block's own piece). Each mark notes how far the
memory record, the domain traffic, the traffic by op and the collective lists had got; ``mesh3d.planner.repeat``
splices the pieces back together for any ``n``.

Usage::

    marks = BlockMarks(model, "layers", 4)       # after the simulator put its meta parameters in
    trace = marks.start(snapshot)                # snapshot() -> Mark, at the step's start
    ...; marks.forward_done(); ...; marks.finish(snapshot(), tracker.events, tp_calls, fsdp_calls)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mesh3d._torch_private import tree_flatten

__all__ = ["BlockMarks", "Mark", "RankTrace"]


@dataclass(frozen=True)
class Mark:
    """How far a step had got: memory events, domain traffic (forward bytes, messages, backward bytes, messages),
    forward bytes by op, tensor-parallel and FSDP collectives."""

    event: int = 0
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)
    by_op: tuple[tuple[str, int], ...] = ()
    tp: int = 0
    fsdp: int = 0


@dataclass
class RankTrace:
    """One simulated step of a model with ``blocks`` repeated blocks, and where it crossed them."""

    blocks: int
    forward: list[tuple[int, Mark]] = field(default_factory=list)  # (block, mark) at each forward pre-hook
    backward: list[tuple[int, Mark]] = field(default_factory=list)  # (block, mark) as its output's gradient arrives
    end: Mark = field(default_factory=Mark)
    events: list[tuple[int, str, int]] = field(default_factory=list)  # MemoryTracker.events
    tp: list[Any] = field(default_factory=list)
    fsdp: list[Any] = field(default_factory=list)


class BlockMarks:
    """Marks a step at the blocks of ``model.<fqn>`` (``count`` of them); see the module docstring."""

    def __init__(self, model: nn.Module, fqn: str, count: int) -> None:
        self.count = count
        self._snapshot: Callable[[], Mark] | None = None
        self._trace: RankTrace | None = None
        self._forward = False
        self._started: set[int] = set()  # blocks whose backward has begun
        self.handles = []
        for i in range(count):
            block = model.get_submodule(f"{fqn}.{i}")
            # NOTE: prepended, so these run before FSDP's emulated hooks: its unshard in pre-forward, its pre-backward
            # (an unshard and the prefetch of the block below) on the output's gradient, fall in the block's piece
            self.handles.append(block.register_forward_pre_hook(self._pre_forward(i), prepend=True))
            self.handles.append(block.register_forward_hook(self._post_forward(i), prepend=True))

    def _pre_forward(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            # NOTE: activation checkpointing runs a block's forward again in backward: only the step's forward marks
            if self._forward and self._trace is not None and self._snapshot is not None:
                self._trace.forward.append((i, self._snapshot()))
        return hook

    def _post_forward(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._forward:
                return
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self._backward_begins(i))
        return hook

    def _backward_begins(self, i: int) -> None:
        if i in self._started or self._trace is None or self._snapshot is None:
            return
        self._started.add(i)
        self._trace.backward.append((i, self._snapshot()))

    def start(self, snapshot: Callable[[], Mark]) -> RankTrace:
        self._snapshot, self._trace, self._forward = snapshot, RankTrace(self.count), True
        self._started = set()
        return self._trace

    def forward_done(self) -> None:
        self._forward = False

    def finish(self, end: Mark, events: list[tuple[int, str, int]], tp: list[Any], fsdp: list[Any]) -> RankTrace:
        trace = self._trace
        assert trace is not None
        trace.end, trace.events, trace.tp, trace.fsdp = end, list(events), list(tp), list(fsdp)
        self._trace = self._snapshot = None
        return trace

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
