"""One rank's training step run on meta tensors: its memory over time, what it sends, what would be refused.

The user's model runs unchanged on a meta input holding this rank's shard: a domain tensor whose
``DomainComm`` has the real domain size and this rank's index but no process group, so mesh3d's own rules,
halo planner and exchanges run as they would (``mesh3d.domain.comm.exchange.dry_run`` counts what each exchange
would send in ``count_traffic`` and posts nothing). Parameters are meta tensors of their tensor-parallel
shape; ``emulate`` adds FSDP's buffers and the TP collectives; ``tracker`` follows every allocation.

Usage::

    sim = Simulator(model_on_meta, plan, layout, InputSpec((1, 1, 64, 64, 64)), device="cpu")
    result = sim.run(domain_index=3)      # RankSim: peak, peak_by_category, domain bytes, collectives, refusals
    sim.close()
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mesh3d._torch_private import checkpoint_module
from mesh3d.domain.attention.backends import PlannedCudaKernels, use_block_kernels
from mesh3d.domain.core.specs import BlockSpec, grid_coords
from mesh3d.domain.comm.divergence import JOURNAL
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import TrafficCounter, count_traffic, dry_run
from mesh3d.domain.dispatch.registry import op_name
from mesh3d.domain.layouts.blocks import simulated_grid
from mesh3d.domain.core.trees import tree_map
from mesh3d.domain.core.split import split_sizes
from mesh3d.domain.core.specs import DomainSpec, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, unwrap, wrap
from mesh3d.parallel.validate import PlanFields
from mesh3d.planner.allocator import cuda_block_bytes
from mesh3d.planner.autocast import AutocastEmulation
from mesh3d.planner.cuda_kernels import cuda_kernel_workspace
from mesh3d.planner.emulate import Collective, FsdpEmulation, TpEmulation
from mesh3d.planner.fused_sdpa import FusedAttention
from mesh3d.planner.layout import ModelLayout
from mesh3d.planner.meta_outputs import MetaOutputs
from mesh3d.planner.tracker import GRADS, HALO, MemoryTracker
from mesh3d.planner.trace import BlockMarks, Mark, RankTrace
from mesh3d.planner.workspace import cpu_kernel_workspace
from mesh3d._torch_private import tree_flatten

__all__ = ["InputSpec", "RankSim", "Simulator", "default_loss"]


def default_loss(output: Any) -> torch.Tensor:
    """The sum of the model's first floating-point output (what ``plan`` and ``check`` backpropagate).

    Usage: ``loss = default_loss(model(x)); loss.backward()``
    """
    if hasattr(output, "to_tuple"):  # Hugging Face ModelOutput
        output = output.to_tuple()
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.sum()
    raise ValueError(f"the model returned no floating-point tensor to backpropagate from ({type(output).__name__}); "
                     "pass loss= a function of the output")


@dataclass(frozen=True)
class InputSpec:
    """One batch rank's input: its global shape and dtype, the dims the domain shards and each rank's sizes.

    Usage: ``InputSpec((1, 1, 256, 256, 256), dims=(2, 3), sizes=None)  # torch.chunk sizes on a 2-D grid``

    ``dims`` default to ``(2,)`` on slabs and ``(2, 3, ...)`` on a domain grid; ``sizes`` (one tuple per sharded
    dim) to ``torch.chunk``'s split, as ``domain.shard`` does.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    dims: tuple[int, ...] | None = None
    sizes: tuple[tuple[int, ...], ...] | None = None

    def layout(self, grid: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """(sharded dims, per-dim sizes) on a domain ``grid``; checked like ``domain.shard``."""
        if self.dims is None and math.prod(grid) == 1:
            return (), ()  # nothing is sharded
        dims = self.dims if self.dims is not None else tuple(range(2, 2 + len(grid)))
        if len(dims) != len(grid):
            raise ValueError(f"the input shards dims {dims} but the domain grid {grid} has {len(grid)} dims; give one "
                             "sharded dim per grid dim")
        if any(not -len(self.shape) <= d < len(self.shape) for d in dims):
            raise ValueError(f"sharded dims {dims} are out of range for an input of shape {self.shape}")
        dims = tuple(d % len(self.shape) for d in dims)
        sizes = self.sizes if self.sizes is not None else (None,) * len(dims)
        if len(sizes) != len(dims):
            raise ValueError(f"sizes {self.sizes} give {len(sizes)} dims' sizes for {len(dims)} sharded dims")
        return dims, tuple(split_sizes(self.shape[d], g, s) for d, g, s in zip(dims, grid, sizes))


@dataclass
class RankSim:
    """What one simulated rank did: memory above its resting state, domain traffic, collectives, refusals."""

    domain_index: int
    peak: int = 0
    peak_by_category: dict[str, int] = field(default_factory=dict)
    domain_bytes: dict[str, int] = field(default_factory=dict)  # "forward"/"backward" -> bytes sent
    domain_messages: dict[str, int] = field(default_factory=dict)
    domain_by_op: dict[str, int] = field(default_factory=dict)  # forward bytes sent, by the op that sent them
    largest_halo: int = 0  # the most bytes one exchange received (its buffers)
    collectives: list[Collective] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # op -> the dispatcher's message
    thin: dict[str, int] = field(default_factory=dict)  # op -> farthest peer it read rows from
    reach: int = 0  # the farthest peer of an exchange that does not involve every peer


@contextlib.contextmanager
def _journal_kept() -> Iterator[None]:
    """Simulated ops are journaled as real ones are; put back this process's own journal afterwards."""
    entries, fingerprint, count = list(JOURNAL.entries), JOURNAL.fingerprint, JOURNAL.count
    try:
        yield
    finally:
        JOURNAL.entries.clear()
        JOURNAL.entries.extend(entries)
        JOURNAL.fingerprint, JOURNAL.count = fingerprint, count


#: Ops whose far exchanges relayout rows (attention's layouts), not halos read from beyond a thin neighbour.
_RELAYOUT_OPS = ("scaled_dot_product_attention", ".attention")


def _cyclic(step: int, n: int) -> int:
    return min(abs(step), n - abs(step))


class _OpWatch(TorchFunctionMode):
    """Attributes forward domain traffic to the torch function that sent it; keeps going past a refused op."""

    def __init__(self, sim: RankSim) -> None:
        super().__init__()
        self.sim = sim
        self.op: str | None = None
        self.in_forward = True  # by_op counts forward traffic; backward's (recomputations included) is not an op's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or not any(issubclass(t, DomainTensor) for t in types):
            return func(*args, **kwargs)
        if self.op is not None:
            # NOTE: a checkpointed module inside a checkpointed module recomputes with the modes entered once per
            # frame, so this watch can see its own op again: the outer call attributes (and falls back), once.
            return func(*args, **kwargs)
        counter = TrafficCounter._active[-1] if TrafficCounter._active else None
        before = counter.bytes_sent if counter is not None else 0
        self.op = op_name(func)
        try:
            return func(*args, **kwargs)
        except NotImplementedError as err:
            self.sim.refused.setdefault(self.op, str(err))
            return _local_fallback(func, args, kwargs)
        finally:
            if counter is not None and counter.bytes_sent > before and self.in_forward:
                self.sim.domain_by_op[self.op] = self.sim.domain_by_op.get(self.op, 0) + counter.bytes_sent - before
            self.op = None


def _local_fallback(func: Callable, args: tuple, kwargs: dict) -> Any:
    """A refused op computed on the local shards, so the simulation can go on and find the next refusal."""
    ref = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, DomainTensor) and sharded_dims(t._spec))
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    local = unwrap(ref)

    def rewrap(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and o.dim() == local.dim() and all(
                o.shape[d] == local.shape[d] for d in sharded_dims(ref._spec)):
            return wrap(o, ref._spec)
        return o

    return tree_map(rewrap, out)


class Simulator:
    """Runs one rank's step on the meta model; one instance serves every rank class of a plan."""

    def __init__(self, model: nn.Module, plan: PlanFields, layout: ModelLayout, inputs: InputSpec, *,
                 device: str = "cuda", loss: Callable[[Any], torch.Tensor] | None = None,
                 outputs: MetaOutputs | None = None, blocks: tuple[str, int] | None = None) -> None:
        """``outputs``: a cache of op outputs to share with other simulators; ``blocks``: (FQN, count) of a
        repeated block stack whose crossings each run records in ``last_trace`` (``mesh3d.planner.trace``)."""
        self.model, self.layout, self.inputs = model, layout, inputs
        self.loss = loss or default_loss
        self.device = device
        self.workspace = cpu_kernel_workspace if device == "cpu" else cuda_kernel_workspace
        self.block_bytes = cuda_block_bytes if device == "cuda" else None
        # NOTE: ring attention's blocks planned as the fused kernels CUDA runs (their log-sum-exp, not a math kernel's
        # scores), with the workspace those kernels hold inside
        self.block_kernels = PlannedCudaKernels(cuda_kernel_workspace) if device == "cuda" else None
        self.meta_outputs = outputs if outputs is not None else MetaOutputs()
        self.autocast = AutocastEmulation(device)
        self.dims, self.sizes = inputs.layout(layout.mesh.grid)
        param_dtype = getattr(plan, "param_dtype", None)
        self._by_unit: dict[str, list[nn.Parameter]] = {}
        self._params = self._meta_parameters(param_dtype)
        self.marks = BlockMarks(model, *blocks) if blocks is not None else None
        self.last_trace: RankTrace | None = None
        for fqn in layout.checkpointed:
            # NOTE: torch function modes are not active in backward, where activation checkpointing recomputes:
            # the recomputation enters the simulation's own ones again, in the autocast state of the forward.
            checkpoint_module(model.get_submodule(fqn),
                              context_fn=lambda: (contextlib.nullcontext(), self._modes(self.autocast.region())))
        self.fsdp = FsdpEmulation(layout, plan) if layout.sharding.fsdp else None
        self.tp = TpEmulation(layout)
        self._handles = self.tp.install(model) + (self.fsdp.install(model) if self.fsdp else [])
        if self.fsdp is not None:
            self.fsdp.release_grads = self._release_grads
        for p in self._params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._note_grad)
        self._tracker: MemoryTracker | None = None
        self._lines: dict[int, int] = {}  # id of a grid line's DomainComm -> its grid dim (blocks)
        self._grid_lines: tuple[DomainComm, ...] = ()  # this rank's grid lines (blocks), for slabs moved to blocks
        self._watch: _OpWatch | None = None

    @contextlib.contextmanager
    def _modes(self, region: contextlib.AbstractContextManager | None = None) -> Iterator[None]:
        """The function modes a step runs under (``FusedAttention`` first: it must stay below the op watch; autocast's
        casts last: they apply before any other mode sees a call); ``region``: an autocast state to recompute in."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(FusedAttention(self.device))
            if self.block_kernels is not None:
                stack.enter_context(use_block_kernels(self.block_kernels))
            if self._watch is not None:
                stack.enter_context(self._watch)
            if region is not None:
                stack.enter_context(region)
            stack.enter_context(self.autocast.casts())
            yield

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self.marks is not None:
            self.marks.remove()

    # ------------------------------------------------------------------ setup
    def _meta_parameters(self, param_dtype: torch.dtype | None) -> list[nn.Parameter]:
        by_name = {p.name: p for p in self.layout.params}
        made: dict[int, nn.Parameter] = {}
        for fqn, module in self.model.named_modules():
            for key, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in made:
                    info = by_name[f"{fqn}.{key}" if fqn else key]
                    made[id(p)] = nn.Parameter(torch.empty(self.layout.tp_shape(info), dtype=param_dtype or p.dtype,
                                                           device="meta"), requires_grad=p.requires_grad)
                    if info.unit is not None:
                        self._by_unit.setdefault(info.unit, []).append(made[id(p)])
                module._parameters[key] = made[id(p)]
            for key, b in list(module._buffers.items()):
                if b is not None and b.device.type != "meta":
                    module._buffers[key] = torch.empty_like(b, device="meta")
        return list(made.values())

    def _note_grad(self, p: torch.Tensor) -> None:
        if self._tracker is not None and p.grad is not None:
            self._tracker.track(p.grad, GRADS)

    def _release_grads(self, unit: str) -> None:
        for p in self._by_unit.get(unit, []):
            p.grad = None

    def _input(self, index: int) -> torch.Tensor:
        grid = self.layout.mesh.grid
        coords = grid_coords(index, grid)
        shape = list(self.inputs.shape)
        for d, sizes, c in zip(self.dims, self.sizes, coords):
            shape[d] = sizes[c]
        local = torch.empty(shape, dtype=self.inputs.dtype, device="meta")
        if self.layout.mesh.domain == 1:
            return local
        domain = DomainComm(None, tuple(range(math.prod(grid))), index)
        if len(grid) == 1:
            return wrap(local, DomainSpec(self.dims[0], self.sizes[0], domain))
        lines = []
        for k, g in enumerate(grid):
            members = tuple(i for i in range(math.prod(grid)) if all(
                a == b for j, (a, b) in enumerate(zip(grid_coords(i, grid), coords)) if j != k))
            lines.append(DomainComm(None, members, coords[k]))
        self._lines = {id(line): k for k, line in enumerate(lines)}
        self._grid_lines = tuple(lines)
        return wrap(local, BlockSpec(self.dims, self.sizes, tuple(lines), domain))

    # ------------------------------------------------------------------ one step
    def run(self, domain_index: int) -> RankSim:
        """Forward, loss, backward of the rank at ``domain_index`` (any batch and model index: they behave alike)."""
        sim = RankSim(domain_index)
        self._lines, self._grid_lines = {}, ()
        x = self._input(domain_index)
        tracker = MemoryTracker(self.workspace, self.meta_outputs, self.block_bytes)
        self._tracker = tracker
        watch = self._watch = _OpWatch(sim)
        grid = self.layout.mesh.grid

        def observe(comm: DomainComm, sends: list, recvs: list) -> None:
            received = sum(b.numel() * b.element_size() for _, b in recvs)
            sim.largest_halo = max(sim.largest_halo, received)
            for _, buf in recvs:
                tracker.track(buf, HALO)
            peers = {p for p, _ in sends} | {p for p, _ in recvs}
            if not peers or len(peers) == comm.size - 1:
                return  # an exchange with every peer depends only on this rank's size and the global sizes
            # Steps along the grid, cyclically (circular padding's wrap-around neighbour is one step away).
            if id(comm) in self._lines or len(grid) == 1:
                far = max(_cyclic(p - comm.index, comm.size) for p in peers)
            else:
                me = grid_coords(comm.index, grid)
                far = max(max(_cyclic(a - b, n) for a, b, n in zip(grid_coords(p, grid), me, grid)) for p in peers)
            sim.reach = max(sim.reach, far)
            op = watch.op or "backward"
            # NOTE: attention moves rows to far ranks on purpose (the causal ring's zigzag layout, Ulysses' heads),
            # not because a shard is thinner than a halo; backward's far exchanges mirror forward's.
            relayout = op.endswith(_RELAYOUT_OPS) or (op == "backward" and not sim.thin)
            if far > 1 and recvs and not relayout:
                sim.thin[op] = max(sim.thin.get(op, 0), far)

        counters: list = []  # the forward's and the backward's traffic counters, once open

        def snapshot() -> Mark:
            f = counters[0]
            b = counters[1] if len(counters) > 1 else None
            return Mark(len(tracker.events or ()), (f.bytes_sent, f.messages, b.bytes_sent if b else 0, b.messages if b else 0),
                        tuple(sim.domain_by_op.items()), len(self.tp.collectives),
                        len(self.fsdp.collectives) if self.fsdp else 0)

        if self.fsdp is not None:
            self.fsdp.start(tracker)
        self.tp.collectives.clear()
        self.last_trace = None
        try:
            grid_of_rank = simulated_grid(grid, self._grid_lines) if self._grid_lines else contextlib.nullcontext()
            with _journal_kept(), dry_run(observe), grid_of_rank, tracker, self.autocast.patched(), self._modes():
                with count_traffic() as forward:
                    counters.append(forward)
                    if self.marks is not None:
                        tracker.record()
                        self.marks.start(snapshot)
                    loss = self.loss(self.model(x))
                watch.in_forward = False
                if self.marks is not None:
                    self.marks.forward_done()
                with count_traffic() as backward:
                    counters.append(backward)
                    loss.backward()
                if self.fsdp is not None:
                    self.fsdp.finish()
                if self.marks is not None:
                    self.last_trace = self.marks.finish(snapshot(), tracker.events or [], self.tp.collectives,
                                                        self.fsdp.collectives if self.fsdp else [])
        except Exception as err:
            where = f" in {watch.op}" if watch.op else ""
            raise ValueError(
                f"the step fails on domain rank {domain_index} of {self.layout.mesh.text()}{where}: "
                f"{type(err).__name__}: {err}. The real run would fail the same way: the plan's styles must leave shapes "
                "that fit (colwise before rowwise), the input must suit the model, and ops on meta tensors cannot read "
                "values (.item(), data-dependent shapes)") from err
        finally:
            self._tracker = self._watch = None
            for p in self._params:
                p.grad = None
        sim.peak, sim.peak_by_category = tracker.peak, tracker.peak_by_category
        sim.domain_bytes = {"forward": forward.bytes_sent, "backward": backward.bytes_sent}
        sim.domain_messages = {"forward": forward.messages, "backward": backward.messages}
        sim.collectives = list(self.tp.collectives) + (list(self.fsdp.collectives) if self.fsdp else [])
        return sim
