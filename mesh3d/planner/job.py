"""``plan_job``: size a (batch, domain, model) job on one CPU, with no process group, in seconds.

1. ``ModelLayout`` validates the ``Plan`` against the model (built on the meta device) and the mesh, as
   ``parallelize`` would, and lays out every parameter.
2. ``DomainClasses`` groups the domain ranks that behave alike; ``Simulator`` runs one rank of each group
   through forward and backward on meta tensors (memory over time, domain traffic, FSDP and TP collectives,
   refused ops). The batch and model axes need no simulation of their own: every batch rank and every model
   rank computes the same shapes.
3. Per-rank arithmetic (FSDP's uneven shards, optimizer state, checkpoint parts) runs as integer vectors over
   the ranks; ranks with equal figures form a class, reported once with its count.

Usage::

    job = plan_job(make_unet, Plan(batch="fsdp"), JobMesh.resolve(4096, domain=(4, 4, 4), model=1),
                   InputSpec((1, 1, 512, 512, 512)), device_memory=80 * 2**30)
    print(job.table())
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mesh3d.domain.core.specs import grid_coords
from mesh3d.domain.probe import downsampling_factor
from mesh3d.parallel.plan import Plan
from mesh3d.planner.ckpt_index import index_bytes
from mesh3d.planner.ckpt_plan import CheckpointLayout
from mesh3d.planner.classes import DomainClasses
from mesh3d.planner.cuda_kernels import CUDA_ASSUMPTIONS
from mesh3d.planner.fanout import Forked, run_each
from mesh3d.planner.layout import ModelLayout, optimizer_state_keys
from mesh3d.mesh_shape import JobMesh
from mesh3d.planner.report import JobPlan, RankClass, human_bytes, spans
from mesh3d.planner.repeat import CannotSplice, SplicedSimulation
from mesh3d.planner.simulate import InputSpec, RankSim, Simulator
from mesh3d.planner.verdict import communicators_used, judge
from mesh3d.planner.workspace import cpu_kernels_fitted
from mesh3d.meta_builds import built_on_meta

__all__ = ["collective_table", "plan_job"]

#: Up to this many target ranks, a reshard's reads are computed for every rank; above, for one rank per class.
_EXACT_RESHARD_RANKS = 64

_COMPILE_BOUND = ("Plan.compile: planned as eager; Inductor's min-cut partitioner saves no more bytes than eager for "
                  "the same graph and its fused kernels skip eager's intermediates, so this is an upper bound, "
                  "less Inductor's own scratch buffers")


def _assumptions(device: str, plan: Plan) -> list[str]:
    return list(CUDA_ASSUMPTIONS if device == "cuda" else _cpu_assumptions()) + ([_COMPILE_BOUND] if plan.compile else [])


def _cpu_assumptions() -> tuple[str, ...]:
    # NOTE: which backend a convolution takes, and what it holds, differ by the CPU's vector width: the plan says
    # which of the fitted models it used (this machine's), since a plan made elsewhere may be read on another CPU.
    return (f"CPU kernels: oneDNN's reorders and the native kernels' im2col for convolutions, {cpu_kernels_fitted()} "
            f"model (this machine's CPU; mesh3d/planner/workspace.py), {torch.get_num_threads()} intra-op threads",)


def _meta_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    if isinstance(model, nn.Module):
        return model if all(t.is_meta for t in model.parameters()) else copy.deepcopy(model).to("meta")
    with built_on_meta():
        built = model()
    if not isinstance(built, nn.Module):
        raise TypeError(f"the model factory returned {type(built).__name__}, not an nn.Module")
    return built


def _factors(model: nn.Module, inputs: InputSpec, dims: tuple[int, ...]) -> tuple[int | None, ...]:
    """The model's downsampling factor along each sharded dim; None where the probe cannot run the model."""
    out: list[int | None] = []
    for d in dims:
        try:
            out.append(downsampling_factor(model, inputs.shape, d, inputs.dtype))
        except Exception:  # noqa: BLE001 - a model the one-rank probe cannot run: classes then key every offset
            out.append(None)
    return tuple(out)


def _simulate_classes(run: Callable[[int], RankSim], mesh: JobMesh, classes_of: Callable[[], DomainClasses | None],
                      workers: int) -> tuple[dict[int, RankSim], list[int]]:
    """Simulate one rank per domain class, growing the neighbourhood radius until every exchange fits in it."""
    # NOTE: domain index 0 is every radius's first representative (and the whole job's one without a domain): it runs
    # first, alone, in this process (a spliced simulation checks its splice there, once) while the classes are keyed
    done = {0: run(0)}
    classes = classes_of()
    if classes is None:
        return done, [0]
    radius = 1
    while True:
        todo = [d for d in classes.representatives(radius).values() if d not in done]
        done.update(run_each(run, todo, workers))
        reach = max(s.reach for s in done.values())
        if reach <= radius or radius >= max(mesh.grid):
            return done, classes.class_of()
        radius = min(reach, max(mesh.grid))


def _simulate(meta: nn.Module, plan: Plan, layout: ModelLayout, mesh: JobMesh, inputs: InputSpec,
              classes: Callable[[], DomainClasses | None], device: str,
              loss: Callable[[Any], torch.Tensor] | None, splice_blocks: bool,
              workers: int) -> tuple[dict[int, RankSim], list[int], str]:
    """Each class's step: from a few blocks of a deep stack, spliced (``mesh3d.planner.repeat``), else the whole
    model; also what was spliced, for the report."""
    spliced = SplicedSimulation.build(meta, plan, mesh, inputs, device, loss) if splice_blocks else None
    if spliced is not None:
        try:
            return (*_simulate_classes(spliced.run, mesh, classes, workers), spliced.note)
        except CannotSplice:
            pass  # NOTE: not provably periodic: the whole model below gives the figures (or the step's own error)
        finally:
            spliced.close()
    sim = Simulator(meta, plan, layout, inputs, device=device, loss=loss)
    try:
        return (*_simulate_classes(sim.run, mesh, classes, workers), "")
    finally:
        sim.close()


def _firsts(inverse: torch.Tensor, classes: int) -> list[int]:
    """The first rank of each class, given every rank's class index."""
    first = torch.full((classes,), len(inverse), dtype=torch.int64)
    return first.scatter_reduce(0, inverse, torch.arange(len(inverse)), "amin").tolist()


def _by_signature(signature: torch.Tensor, classes: list[RankClass]) -> list[tuple[int, int]]:
    """(example rank, ranks) per distinct checkpoint signature: classes that write alike, counted together."""
    out: dict[int, list[int]] = {}
    for c in classes:
        out.setdefault(int(signature[c.examples[0]]), [c.examples[0], 0])[1] += c.count
    return [(rank, count) for rank, count in out.values()]


def collective_table(rows: Iterable[tuple[str, str, str, int, int]]) -> list[dict[str, Any]]:
    """Collective calls (axis, kind, phase, bytes sent, result bytes) summed per (axis, kind, phase), as a job reports
    them; a measured run's rows (``mesh3d.planner.measure.CollectiveCounter.rows``) go through the same table.

    Usage: ``collective_table(counter.rows)``
    """
    table: dict[tuple[str, str, str], dict[str, Any]] = {}
    for axis, kind, phase, sent, result in rows:
        row = table.setdefault((axis, kind, phase), {"axis": axis, "collective": kind, "phase": phase, "calls": 0,
                                                     "bytes": 0, "result_bytes": 0})
        row["calls"] += 1
        row["bytes"] += sent
        row["result_bytes"] += result
    return sorted(table.values(), key=lambda r: (r["axis"], r["phase"] != "forward", r["collective"]))


def _static_memory(layout: ModelLayout, optimizer: str) -> tuple[dict[str, int], torch.Tensor, torch.Tensor]:
    """(bytes every rank holds alike, unpadded parameter bytes per FSDP shard index, optimizer bytes per shard index)."""
    keys = optimizer_state_keys(optimizer)
    shards = layout.sharding.shard if layout.sharding.fsdp else 1
    s = torch.arange(shards, dtype=torch.int64)
    held = torch.zeros(shards, dtype=torch.int64)
    opt = torch.zeros(shards, dtype=torch.int64)
    grads = 0
    step = torch.float64.itemsize if torch.get_default_dtype() == torch.float64 else torch.float32.itemsize
    for p in layout.params:
        if layout.sharding.fsdp:
            c, rows = layout.chunk(p), layout.tp_shape(p)[0]
            local = (rows - s * c).clamp(0, c) * layout.rest(p)
        else:
            local = torch.full_like(s, math.prod(layout.tp_shape(p)))
        held += local * p.itemsize
        if p.requires_grad:
            opt += len(keys) * local * p.itemsize + (step if optimizer.lower() in ("adam", "adamw") else 0)
            grads += layout.param_storage(p) if layout.sharding.fsdp else math.prod(layout.tp_shape(p)) * p.itemsize
    fixed = {"params": sum(layout.param_storage(p) for p in layout.params), "grads": grads,
             "buffers": sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _ in layout.buffers)}
    return fixed, held, opt


def _reshard(source: CheckpointLayout, target: CheckpointLayout, to: JobMesh) -> dict[str, Any]:
    n = to.world
    exact = n <= _EXACT_RESHARD_RANKS
    if exact:
        ranks = list(range(n))
        weights = dict.fromkeys(ranks, 1)
    else:  # one rank per class of equal box shapes (reads may differ by a checksum block at chunk edges)
        _, inverse, counts = torch.unique(target.signatures(held=True), return_inverse=True, return_counts=True)
        ranks = _firsts(inverse, len(counts))
        weights = dict(zip(ranks, counts.tolist()))
    groups: dict[tuple[int, int, int], list[int]] = {}
    for r in ranks:
        groups.setdefault(source.read_cost(target, r), []).append(r)
    classes = [{"count": sum(weights[r] for r in rs), "ranks": spans(rs) if exact else "", "examples": rs[:3],
                "bytes_needed": k[0], "bytes_read": k[1], "files_opened": k[2]} for k, rs in groups.items()]
    return {"to": to.text(), "bytes_needed": sum(c["count"] * c["bytes_needed"] for c in classes),
            "bytes_read": sum(c["count"] * c["bytes_read"] for c in classes), "exact": exact,
            "classes": sorted(classes, key=lambda c: -c["count"])}


def plan_job(model: nn.Module | Callable[[], nn.Module], plan: Plan | None, mesh: JobMesh, inputs: InputSpec, *,
             optimizer: str = "adamw", to: JobMesh | None = None, device_memory: int | None = None,
             device: str = "cuda", loss: Callable[[Any], torch.Tensor] | None = None, name: str | None = None,
             margin: int | None = None, splice_blocks: bool = True, workers: int = 1) -> JobPlan:
    """Plan one training step of ``model`` under ``plan`` on ``mesh`` (see the module docstring).

    Usage: ``print(plan_job(make_model, Plan(), JobMesh.resolve(8, domain=2), InputSpec((1, 1, 64, 64))).table())``

    ``inputs`` is one batch rank's input (the domain shards it); ``optimizer`` is ``adamw``, ``adam``, ``sgd``
    or ``none``; ``to`` plans loading the checkpoint onto another mesh; ``device_memory`` (bytes) is what the
    verdict compares each class's peak plus the margin with (``mesh3d.planner.verdict``; ``margin`` in bytes
    replaces its estimate); ``device="cuda"`` models CUDA kernels and the caching allocator
    (``mesh3d.planner.cuda_kernels``), ``"cpu"`` CPU kernels (``mesh3d.planner.workspace``); ``loss(output)``
    defaults to the sum of the first floating output; ``splice_blocks=False`` simulates every block of a deep stack
    (``mesh3d.planner.repeat``: the same figures, slower); ``workers`` > 1 simulates the domain classes in that many
    forked processes (``mesh3d.planner.fanout``: the same figures, sooner on as many free cores).
    """
    start = time.perf_counter()
    plan = plan if plan is not None else Plan()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: plan for 'cuda' (cuDNN/cuBLAS/attention workspaces, the caching allocator) "
                         "or 'cpu' (oneDNN/im2col workspaces)")
    meta = _meta_model(model)
    layout = ModelLayout.build(meta, plan, mesh)
    target = ModelLayout.build(meta, plan, to) if to is not None else None
    dims, sizes = inputs.layout(mesh.grid)
    # NOTE: the downsampling probe runs the whole model once; with workers it runs in a child beside the first class
    probe = Forked(lambda: _factors(meta, inputs, dims)) if workers > 1 and mesh.domain > 1 else None

    @functools.cache
    def classes() -> DomainClasses | None:
        if mesh.domain == 1:
            return None
        return DomainClasses(mesh.grid, sizes, probe.result() if probe is not None else _factors(meta, inputs, dims))

    try:
        sims, class_of, spliced = _simulate(meta, plan, layout, mesh, inputs, classes, device, loss, splice_blocks,
                                            workers)
    finally:
        if probe is not None:
            probe.cancel()

    fixed, held, opt = _static_memory(layout, optimizer)
    ckpt = CheckpointLayout(layout, optimizer)
    r = torch.arange(mesh.world, dtype=torch.int64)
    d = (r // mesh.model) % mesh.domain
    s = (r // mesh.model) % (layout.sharding.shard if layout.sharding.fsdp else 1)
    dom = torch.tensor(class_of, dtype=torch.int64)[d]
    static_key = held * 1000003 + opt
    rows = torch.stack([dom, static_key[s], ckpt.signatures()], 1)
    _, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
    # NOTE: one rank per checkpoint signature: ranks of one signature write parts of the same shapes (their files
    # differ at most in the rank their headers name), so asking each class's first rank repeats the same question
    _, by_signature = torch.unique(rows[:, 2], return_inverse=True)
    if ckpt.header_names_matter(_firsts(by_signature, int(by_signature.max()) + 1)):
        rows = torch.stack([dom, static_key[s], ckpt.signatures(digits=True)], 1)
        _, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
    firsts = _firsts(inverse, len(counts))
    # NOTE: files depend only on the checkpoint signature (classes also differ by domain position): sized once each.
    sized: dict[int, tuple[int, dict[str, int]]] = {}

    def files_of(rank: int) -> dict[str, int]:
        key = int(rows[rank, 2])
        if key not in sized:
            sized[key] = (rank, ckpt.files(rank))
        first, files = sized[key]
        return {name.replace(f"r{first:05d}-", f"r{rank:05d}-"): size for name, size in files.items()}

    result: list[RankClass] = []
    for k in sorted(range(len(counts)), key=firsts.__getitem__):
        members = (inverse == k).nonzero().flatten()
        rep = int(members[0])
        rs = sims[class_of[int(d[rep])]]
        b, dd, m = mesh.coords(rep)
        local_input = math.prod(inputs.shape) // math.prod(inputs.shape[x] for x in dims) * math.prod(
            sz[c] for sz, c in zip(sizes, grid_coords(dd, mesh.grid))) * inputs.dtype.itemsize
        memory = {"params": fixed["params"], "params_unpadded": int(held[s[rep]]), "grads": fixed["grads"],
                  "optimizer": int(opt[s[rep]]), "buffers": fixed["buffers"], "input": local_input, "step_peak": rs.peak}
        memory["peak"] = memory["params"] + memory["optimizer"] + memory["buffers"] + local_input + rs.peak
        result.append(RankClass(int(counts[k]), spans(members.tolist()), members[:4].tolist(), {"batch": b, "domain": dd, "model": m}, memory,
                                dict(rs.peak_by_category), collective_table(rs.collectives),
                                {"bytes": rs.domain_bytes, "messages": rs.domain_messages, "by_op": rs.domain_by_op,
                                 "largest_halo_received": rs.largest_halo}, files_of(rep)))

    files = [(c.count, size) for c in result for size in c.checkpoint_files.values()]
    checkpoint = {"files": sum(n for n, _ in files), "bytes": sum(n * size for n, size in files),
                  "largest_file": max((size for _, size in files), default=0),
                  "writers": sum(c.count for c in result if c.checkpoint_files),
                  "index_bytes": index_bytes(ckpt, _by_signature(rows[:, 2], result), optimizer)}
    reshard = _reshard(ckpt, CheckpointLayout(target, optimizer), to) if target is not None and to is not None else None

    warnings = list(layout.warnings)
    padded = [(p.name, layout.tp_shape(p)[0]) for p in layout.params
              if layout.sharding.fsdp and layout.chunk(p) * layout.sharding.shard >= 2 * layout.tp_shape(p)[0]]
    if padded:
        waste = sum(layout.param_storage(p) * layout.sharding.shard - math.prod(layout.tp_shape(p)) * p.itemsize
                    for p in layout.params if p.name in dict(padded))
        warnings.append(f"FSDP pads {len(padded)} parameter(s) whose dim 0 is small next to the {layout.sharding.shard}-way "
                        f"shard to at least twice their size ({', '.join(f'{n} ({r} rows)' for n, r in padded[:4])}"
                        f"{', ...' if len(padded) > 4 else ''}): {human_bytes(waste)} of padding over the shard group, "
                        "gathered in full; put the long dim first, or use HSDP with a smaller shard")
    refused: dict[str, str] = {}
    thin: dict[str, int] = {}
    for rs in sims.values():
        refused.update(rs.refused)
        for op, far in rs.thin.items():
            thin[op] = max(thin.get(op, 0), far)
    warnings += [f"{op}: domain ranks read halo rows from ranks up to {far} grid steps away (shards thinner than the "
                 "halo: it works, with more messages; fewer domain ranks, or blocks, avoid it)" for op, far in thin.items()]
    if refused:
        warnings.append("the ops above have no domain rule: the model cannot run on this domain as written, and the "
                        "figures after the first of them assume each ran on the local shard")
    verdict = judge(result, device=device, device_memory=device_memory, margin=margin,
                    communicators=communicators_used(result))
    if verdict["over"] and device_memory is not None:
        over, worst = verdict["over"], verdict["worst_class"]
        warnings.append(f"{len(over)} of {len(result)} classes ({sum(result[i].count for i in over)} ranks) need more than "
                        f"the {human_bytes(device_memory)} of device memory with the margin; the most, class {worst} "
                        f"(e.g. rank {result[worst].examples[0]}), peaks at {human_bytes(verdict['peak'])} + "
                        f"{human_bytes(verdict['margin']['total'])}")
    return JobPlan(name or getattr(model, "__qualname__", type(meta).__name__), mesh.text(), mesh.world,
                   plan.describe(), {"shape": list(inputs.shape), "dtype": str(inputs.dtype).replace("torch.", ""),
                                     "sharded_dims": list(dims), "sizes": [list(x) for x in sizes]},
                   optimizer, device, result, checkpoint, reshard, warnings, refused, len(sims),
                   time.perf_counter() - start, verdict, _assumptions(device, plan), spliced)
