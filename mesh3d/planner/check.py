"""One mesh of ``mesh3d check``, run on every rank: the parallelized model against the same model in one process.

Every rank builds the model twice from the same seed in float64: a reference it runs in one process on the
whole global batch, and a copy it parallelizes with the plan on the current mesh and feeds this batch rank's
input, domain-sharded into the given (uneven) sizes. The loss is ``<output, cotangent>`` with a random
cotangent (every output element weighs differently); the reference's is averaged over the batch ranks, as
mesh3d's gradients are. Output, loss and every parameter gradient are compared as the largest difference
relative to the reference's largest magnitude (a gradient that is zero in exact arithmetic is measured
against the model's largest gradient). The reference is also examined for what it exercised (``exercise.py``:
parameters with an exactly zero gradient, an output that ignores or is the input). With ``save_to`` the rank then takes an AdamW step and saves a
checkpoint (rank 0 also writes the whole expected state); with ``load_from`` it loads one saved on another
mesh and compares every whole tensor with the expected state, bitwise.

Usage (on ranks already in one process group)::

    result = check_on_rank(CheckSpec("mypkg:make_unet", None, InputSpec((1, 1, 32, 32))), JobMesh(1, (2,), 1),
                           ((20, 12),))
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from mesh3d.checkpoint.load import load
from mesh3d.checkpoint.save import save
from mesh3d.domain.api import shard
from mesh3d.domain.graph import edge_index, shard_nodes
from mesh3d.graphs import Graph
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.core.specs import Layout, sharded_dims
from mesh3d.manager import DistributedManager
from mesh3d.parallel.apply import parallelize
from mesh3d.parallel.plan import Plan
from mesh3d.planner.exercise import exercise_of, perturb_zero_parameters, zero_at_init
from mesh3d.planner.graph_job import load_graph, partition_graph
from mesh3d.mesh_shape import JobMesh
from mesh3d.planner.simulate import InputSpec
from mesh3d.planner.spec import load_model_factory, load_plan
from mesh3d._torch_private import tree_flatten

__all__ = ["CheckSpec", "check_on_rank", "relative_difference"]


@dataclass(frozen=True)
class CheckSpec:
    """What to check: the model factory, its plan (a Plan, a ``module:name`` or None) and one batch rank's input.

    Usage: ``CheckSpec("mypkg.models:make_unet", "mypkg.plans:PLAN", InputSpec((1, 1, 32, 32)))``
    """

    model: str | Callable[[], nn.Module]
    plan: str | Plan | None
    inputs: InputSpec
    #: give parameters that are zero throughout at initialisation small random values first (``exercise.py``)
    perturb_zero_init: bool = False
    #: a graph (``planner.graph_job.load_graph``): the model is called ``model(x, edge_index)`` with ``x`` its node
    #: features (``inputs``; the node dim ``inputs.dims[0]``, default 0 for ``(N, F)``, 1 for ``(B, N, F)``)
    graph: str | None = None

    def node_dim(self) -> int:
        return self.inputs.dims[0] if self.inputs.dims else (0 if len(self.inputs.shape) == 2 else 1)


def relative_difference(a: Any, b: Any, floor: float = 0.0) -> float:
    """Largest ``|a - b|`` over the largest ``|b|`` (or ``floor`` where that is larger); inf if shapes differ.

    Usage: ``relative_difference(parallel_grad, reference_grad, floor=largest_grad)``
    """
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(max(floor, 1e-300)))


def _fp64(model: nn.Module) -> nn.Module:
    model.double()
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_complex():
            t.data = t.data.to(torch.complex128)
    return model


def _first_float(output: Any) -> torch.Tensor:
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    found = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if found is None:
        raise ValueError(f"the model returned no floating-point tensor ({type(output).__name__})")
    return found


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The one-process value of a parallel result: domain shards gathered, DTensors made whole."""
    if isinstance(t, DomainTensor):
        return (t.full_tensor() if sharded_dims(t.spec) else t).to_local()
    if isinstance(t, DTensor):
        # NOTE: one mesh dim at a time, the outermost (FSDP's) first: full_tensor() of a parameter split twice along one
        # dim (FSDP over tensor parallelism) runs the same all-gathers but logs that it cannot merge them.
        mesh = t.device_mesh
        for k in range(mesh.ndim):
            t = t.redistribute(mesh, [Replicate()] * (k + 1) + list(t.placements[k + 1:]))
        return t.to_local()
    return t


def _input(spec: InputSpec, batch_index: int) -> torch.Tensor:
    """Batch rank ``batch_index``'s input (-1: another one, to see whether the output depends on it)."""
    g = torch.Generator().manual_seed(1000 + batch_index if batch_index >= 0 else 3000)
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, generator=g, dtype=torch.float64)
    return torch.randint(0, 2, spec.shape, generator=g, dtype=spec.dtype)  # token ids any vocabulary holds


def _shard(x: torch.Tensor, spec: InputSpec, mesh: JobMesh, sizes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    dims, _ = spec.layout(mesh.grid)
    if mesh.domain == 1:
        return x
    if len(mesh.grid) > 1:
        return shard(x, dims=dims, sizes=sizes)
    return shard(x, dim=dims[0], sizes=sizes[0])


def _like(cot: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The cotangent laid out as the parallel output is."""
    if isinstance(y, DomainTensor) and y.spec.layout is Layout.GRAPH:
        return shard_nodes(cot, y.spec.items, y.spec.dim)  # type: ignore[attr-defined]
    if isinstance(y, DomainTensor) and sharded_dims(y.spec):
        spec = y.spec
        if spec.layout is Layout.BLOCKS:
            return shard(cot, dims=spec.dims, sizes=spec.sizes)  # type: ignore[attr-defined]
        return shard(cot, dim=spec.dim, sizes=spec.sizes)
    return cot


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, whole (collective over the mesh: every rank calls it)."""
    state = {name: _whole(t).detach().clone() for name, t in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, values in opt.state.items():
        for key, value in values.items():
            state[f"optimizer.{names[p]}.{key}"] = _whole(value).detach().clone().reshape(value.shape)
    return state


def _compare(model: nn.Module, ref: nn.Module, y: torch.Tensor, y_ref: torch.Tensor, loss: torch.Tensor,
             loss_ref: torch.Tensor) -> dict[str, float]:
    diffs = {"output": relative_difference(_whole(y), y_ref), "loss": relative_difference(_whole(loss), loss_ref)}
    grads = [p.grad for p in ref.parameters() if p.grad is not None and p.grad.numel()]
    scale = max((float(g.abs().max()) for g in grads), default=0.0)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        grad = _whole(p.grad) if p.grad is not None else None
        diffs[f"grad {name}"] = relative_difference(grad, p_ref.grad, scale)
    return diffs


def _run(spec: CheckSpec, mesh: JobMesh, sizes: tuple[tuple[int, ...], ...], save_to: str | None,
         load_from: str | None) -> dict[str, Any]:
    dm = DistributedManager()
    factory, plan = load_model_factory(spec.model), load_plan(spec.plan)
    torch.manual_seed(0)
    ref = _fp64(factory())
    zero = zero_at_init(ref)
    perturbed = perturb_zero_parameters(ref) if spec.perturb_zero_init else []
    model = copy.deepcopy(ref)
    b = dm.axis_rank("batch")
    xs = [_input(spec.inputs, i) for i in range(mesh.batch)]
    graph = load_graph(spec.graph) if spec.graph else None
    extra = (torch.from_numpy(graph.edge_index),) if graph is not None else ()
    outs = [_first_float(ref(x, *extra)) for x in xs]
    cots = [torch.randn(y.shape, generator=torch.Generator().manual_seed(2000 + i), dtype=y.dtype)
            for i, y in enumerate(outs)]
    losses = [(y * c).sum() for y, c in zip(outs, cots)]
    (sum(losses) / mesh.batch).backward()
    with torch.random.fork_rng():  # NOTE: the parallel run draws what it would have drawn without this extra forward
        exercise = exercise_of(ref, xs[0], outs[0], lambda x: _first_float(ref(x, *extra)), _input(spec.inputs, -1), zero,
                               perturbed)

    model = parallelize(model, plan)
    if graph is not None:  # the nodes along a Hilbert curve (uneven sizes), the edges with their destinations
        part = partition_graph(graph, mesh.domain, "hilbert", sizes[0] if mesh.domain > 1 else None)
        y = _first_float(model(shard_nodes(xs[b], part, spec.node_dim()), edge_index(Graph(graph.edge_index, part))))
    else:
        y = _first_float(model(_shard(xs[b], spec.inputs, mesh, sizes)))
    loss = (y * _like(cots[b], y)).sum()
    loss.backward()
    result: dict[str, Any] = {"status": "ok", "diffs": _compare(model, ref, y, outs[b].detach(), loss, losses[b].detach()),
                              "exercise": asdict(exercise)}
    if save_to is not None or load_from is not None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if save_to is not None:
            opt.step()
            save(save_to, model, opt, step=1)
            expected = _full_state(model, opt)
            if dm.rank == 0:
                save_file({k: v.contiguous() for k, v in expected.items()}, save_to + ".expected.safetensors")
            result["saved"] = len(expected)
        else:
            # NOTE: torch's optimizer-state template (DCP's _init_optim_state) initializes an empty optimizer only
            # when no parameter has a gradient; with this step's gradients still there it would not.
            opt.zero_grad(set_to_none=True)
            load(load_from, model, opt)
            got = _full_state(model, opt)
            expected = load_file(load_from + ".expected.safetensors")
            result["loaded"] = len(expected)
            result["mismatched"] = sorted(k for k in expected.keys() | got.keys() if k not in got or k not in expected
                                          or not torch.equal(got[k], expected[k]))
    return result


def check_on_rank(spec: CheckSpec, mesh: JobMesh, sizes: tuple[tuple[int, ...], ...], save_to: str | None = None,
                  load_from: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """Run one mesh of ``mesh3d check`` on this rank (every rank of the mesh calls it; see the module docstring).

    Usage: ``check_on_rank(spec, JobMesh(2, (2,), 1), ((20, 12),), save_to="/tmp/ck/a")``

    Returns ``{"status": "ok", "diffs": {name: relative difference}, ...}`` or ``{"status": "error", "error": ...}``
    (a failure on any rank is reported, not raised; a rank its peers wait on is named after ``timeout_s``).
    """
    DistributedManager.initialize(mesh.batch, mesh.grid if len(mesh.grid) > 1 else mesh.domain, mesh.model,
                                  timeout=timeout_s)
    try:
        return _run(spec, mesh, sizes, save_to, load_from)
    except Exception as err:  # noqa: BLE001 - reported in the verdict table, rank by rank
        return {"status": "error", "error": f"{type(err).__name__}: {err}"}
    finally:
        DistributedManager.shutdown()
