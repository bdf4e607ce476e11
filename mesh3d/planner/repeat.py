"""Plan a deep stack of identical blocks from a few of them: simulate 4 blocks, splice the step to all ``n``.

An 8B decoder is 32 identical layers; simulating every one for every rank class was most of a plan's time. Its
step is periodic in the blocks (``mesh3d.planner.trace``): the interior blocks' forwards record the same memory
changes, traffic and collectives, and so do their backwards. ``splice`` builds the ``n``-block step's record from
a 4-block one (prefix, first forward, the interior forward ``n - 2`` times, the tail, the last block's backward,
the interior backward ``n - 2`` times, the first backward with the end) and reads the figures off it as the tracker would have: the peak is
the first maximum of the live bytes over the spliced record, with its breakdown, so a peak that moves from the
head to the middle of the stack as ``n`` grows is found where it is.

Nothing is assumed: each rank's 4-block record must show its two interior pieces alike, and the first rank
planned is also simulated with 5 blocks, whose figures must equal the 4-block record spliced to 5. Otherwise (or
where a shortened model does not run) the plan simulates the whole model, as before.

Usage::

    spliced = SplicedSimulation.build(meta_model, plan, mesh, inputs, device="cuda")   # None: no deep stack
    rank_sim = spliced.run(domain_index)       # raises CannotSplice: simulate the whole model instead
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mesh3d.mesh_shape import JobMesh
from mesh3d.parallel.validate import PlanFields
from mesh3d.planner.layout import ModelLayout
from mesh3d.planner.meta_outputs import MetaOutputs
from mesh3d.planner.simulate import InputSpec, RankSim, Simulator
from mesh3d.planner.trace import Mark, RankTrace
from mesh3d.planner.tracker import ADDED, REMOVED, SPIKE

__all__ = ["CannotSplice", "SplicedSimulation", "find_repeat", "splice"]

#: Blocks simulated per rank (two interior ones to compare), and the check's count; stacks of fewer than
#: ``_DEEP`` blocks are simulated whole (splicing would save little).
_BASE, _CHECK, _DEEP = 4, 5, 8


class CannotSplice(Exception):
    """The step is not periodic in the blocks (or the shortened model does not run): simulate the whole model."""


def _signature(module: nn.Module) -> tuple:
    return (tuple((n, type(m)) for n, m in module.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()))


def find_repeat(model: nn.Module) -> tuple[str, int] | None:
    """(FQN, count) of the model's largest ``nn.ModuleList``/``nn.Sequential`` (exactly those) of at least 8 identical
    blocks that share nothing with each other or with the rest of the model; None when there is none.

    Usage: ``find_repeat(llama_8b_on_meta)  # ("layers", 32)``
    """
    seen: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    params: dict[int, int] = {}
    for _, m in model.named_modules():
        for p in m.parameters(recurse=False):
            params[id(p)] = params.get(id(p), 0) + 1
    best: tuple[int, str, int] | None = None
    for fqn, stack in model.named_modules():
        if not fqn or type(stack) not in (nn.ModuleList, nn.Sequential) or len(stack) < _DEEP:
            continue  # NOTE: exactly these: a subclass's own forward or constructor could not be shortened alike
        blocks = list(stack)
        first = _signature(blocks[0])
        if any(_signature(b) != first for b in blocks[1:]):
            continue
        inner = [m for b in blocks for m in b.modules()]
        if any(seen[id(m)] != 1 for m in inner) or any(params[id(p)] != 1 for m in inner for p in m.parameters(False)):
            continue  # a block (or a weight) reachable twice: tied, or referred to from outside the stack
        size = len(blocks) * sum(p.numel() for p in blocks[0].parameters())
        if best is None or size > best[0]:
            best = (size, fqn, len(blocks))
    return (best[1], best[2]) if best is not None else None


def shortened(model: nn.Module, fqn: str, count: int) -> nn.Module:
    """A deep copy of ``model`` whose stack at ``fqn`` keeps its first ``count`` blocks (the same names)."""
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    stack = parent.get_submodule(name)
    assert isinstance(stack, (nn.ModuleList, nn.Sequential))
    blocks = list(stack)[:count]
    setattr(parent, name, type(stack)(*blocks) if isinstance(stack, nn.Sequential) else nn.ModuleList(blocks))
    try:
        return copy.deepcopy(model)
    finally:
        setattr(parent, name, stack)


# ---------------------------------------------------------------------- splicing
def _piece(trace: RankTrace, a: Mark, b: Mark) -> tuple:
    """What happened between two marks: memory events, traffic counts, bytes by op, collectives."""
    counts = tuple(y - x for x, y in zip(a.counts, b.counts))
    before = dict(a.by_op)
    by_op = tuple((op, n - before.get(op, 0)) for op, n in b.by_op if n != before.get(op, 0))
    return (tuple(trace.events[a.event:b.event]), counts, by_op, tuple(trace.tp[a.tp:b.tp]),
            tuple(trace.fsdp[a.fsdp:b.fsdp]))


def _pieces(trace: RankTrace) -> tuple[list[tuple], tuple, tuple]:
    """The step's pieces (prefix, first forward, interior forward, tail, last backward, interior backward, first
    backward and end), the interior forward, the interior backward; CannotSplice when interior blocks differ."""
    k = trace.blocks
    if [i for i, _ in trace.forward] != list(range(k)) or [i for i, _ in trace.backward] != list(range(k - 1, -1, -1)):
        raise CannotSplice("the blocks did not run once each, in order, forward and backward")
    f = [m for _, m in trace.forward]
    b = [m for _, m in reversed(trace.backward)]  # by block
    forwards = [_piece(trace, f[i], f[i + 1]) for i in range(k - 1)]  # block i's forward, up to block i+1's
    backwards = [_piece(trace, b[i], b[i - 1]) for i in range(1, k)]  # block i's backward, up to block i-1's
    interior_f, interior_b = forwards[1:k - 1], backwards[:k - 2]
    if any(p != interior_f[0] for p in interior_f) or any(p != interior_b[0] for p in interior_b):
        raise CannotSplice("the interior blocks do not record alike")
    return ([_piece(trace, Mark(), f[0]), forwards[0], interior_f[0], _piece(trace, f[k - 1], b[k - 1]),
             backwards[k - 2], interior_b[0], _piece(trace, b[0], trace.end)], interior_f[0], interior_b[0])


def _peak(events: list[tuple[int, str, int]]) -> tuple[int, dict[str, int]]:
    """The tracker's peak and breakdown for a record: its first maximum of live bytes (a spike's bytes on top)."""
    if not events:
        return 0, {}
    names = list(dict.fromkeys(c for _, c, _ in events))
    kind = torch.tensor([e[0] for e in events], dtype=torch.int64)
    cat = torch.tensor([names.index(e[1]) for e in events], dtype=torch.int64)
    nbytes = torch.tensor([e[2] for e in events], dtype=torch.int64)
    delta = torch.where(kind == ADDED, nbytes, torch.where(kind == REMOVED, -nbytes, 0))
    current = delta.cumsum(0)
    value = torch.where(kind == SPIKE, current + nbytes, current)
    value = torch.where(kind == REMOVED, -1, value)  # a release is never a new peak
    top = int(value.max())
    if top <= 0:
        return 0, {}
    at = int(torch.argmax(value))  # the first maximum, as the tracker keeps the first
    first_added = {}
    for i, (k, c, _) in enumerate(events[:at + 1]):
        if k == ADDED and c not in first_added:
            first_added[c] = i
    per_cat = torch.zeros(len(names), dtype=torch.int64).index_add_(0, cat[:at + 1], delta[:at + 1])
    breakdown = {c: int(per_cat[names.index(c)]) for c in sorted(first_added, key=first_added.get)
                 if int(per_cat[names.index(c)])}
    if events[at][0] == SPIKE and events[at][2]:
        breakdown[events[at][1]] = breakdown.get(events[at][1], 0) + events[at][2]
    return top, breakdown


def splice(trace: RankTrace, sim: RankSim, n: int) -> RankSim:
    """``sim`` (with ``trace``) of a ``trace.blocks``-block model, as the ``n``-block model's step (module docstring).

    Usage: ``splice(short_sim.last_trace, rank_sim, 32)``
    """
    pieces, forward, backward = _pieces(trace)
    order = pieces[:2] + [forward] * (n - 2) + pieces[3:5] + [backward] * (n - 2) + pieces[6:]
    events = [e for p in order for e in p[0]]
    peak, breakdown = _peak(events)
    counts = [sum(p[1][i] for p in order) for i in range(4)]
    by_op: dict[str, int] = {}
    for p in order:
        for op, nbytes in p[2]:
            by_op[op] = by_op.get(op, 0) + nbytes
    collectives = [c for p in order for c in p[3]] + [c for p in order for c in p[4]]
    return replace(sim, peak=peak, peak_by_category=breakdown, domain_bytes={"forward": counts[0], "backward": counts[2]},
                   domain_messages={"forward": counts[1], "backward": counts[3]},
                   domain_by_op={op: b for op, b in by_op.items() if b}, collectives=collectives)


class SplicedSimulation:
    """Each rank simulated with 4 blocks of the stack and spliced to all of them (see the module docstring)."""

    def __init__(self, model: nn.Module, repeat: tuple[str, int], plan: PlanFields, mesh: JobMesh, inputs: InputSpec,
                 device: str, loss: Callable[[Any], torch.Tensor] | None) -> None:
        self.fqn, self.blocks = repeat
        outputs = MetaOutputs()

        def simulator(count: int) -> Simulator:
            try:
                short = shortened(model, self.fqn, count)
                layout = ModelLayout.build(short, plan, mesh)
                return Simulator(short, plan, layout, inputs, device=device, loss=loss, outputs=outputs,
                                 blocks=(self.fqn, count))
            except Exception as err:  # noqa: BLE001 - e.g. a plan naming a block past the shortened stack
                raise CannotSplice(f"the model with {count} blocks cannot be simulated: {err}") from err

        self._simulator = simulator
        self._base = simulator(_BASE)
        self._checked = False

    @classmethod
    def build(cls, model: nn.Module, plan: PlanFields, mesh: JobMesh, inputs: InputSpec, device: str,
              loss: Callable[[Any], torch.Tensor] | None) -> SplicedSimulation | None:
        """None where the model has no stack deep enough (``find_repeat``) or cannot be shortened."""
        repeat = find_repeat(model)
        if repeat is None:
            return None
        try:
            return cls(model, repeat, plan, mesh, inputs, device, loss)
        except CannotSplice:
            return None

    @property
    def note(self) -> str:
        return f"{_BASE} of the {self.blocks} blocks of {self.fqn!r} each, the rest spliced in"

    def _run(self, sim: Simulator, domain_index: int) -> tuple[RankSim, RankTrace]:
        try:
            rank = sim.run(domain_index)
        except ValueError as err:
            raise CannotSplice(str(err)) from err
        assert sim.last_trace is not None
        return rank, sim.last_trace

    def run(self, domain_index: int) -> RankSim:
        """The rank's ``RankSim`` for the whole model; CannotSplice where that cannot be shown exact."""
        rank, trace = self._run(self._base, domain_index)
        if not self._checked:
            check = self._simulator(_CHECK)
            try:
                rank5, trace5 = self._run(check, domain_index)
            finally:
                check.close()
            if splice(trace, rank, _CHECK) != rank5 or splice(trace5, rank5, _CHECK) != rank5:
                raise CannotSplice(f"the {_CHECK}-block step differs from the {_BASE}-block step spliced to {_CHECK}")
            self._checked = True
        return splice(trace, rank, self.blocks)

    def close(self) -> None:
        self._base.close()
