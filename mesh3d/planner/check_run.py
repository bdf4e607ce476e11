"""``check_model``: does a user's model with its plan give the one-process answer on small uneven meshes?

For each mesh (by default: domain 2 and domain 3 with uneven rows, batch 2 x domain 2, and model 2 when the
plan has tensor-parallel styles) the planner first runs the step on meta tensors and lists the ops the
dispatcher would refuse, with the fix its message gives; a mesh without refusals then runs for real
(``check.check_on_rank``) on as many gloo ranks, in float64, against one process. The first mesh that runs
saves a checkpoint and every later one loads it, bitwise. A model that differs is never reported equal:
every relative difference above ``tolerance`` makes its mesh DIFFERENT. A check that could not have failed (the
reference's output ignores or is the input, or most parameters get exactly zero gradient: ``exercise.py``) is
reported ``degenerate``; ``passed`` is then false unless ``allow_degenerate``.

Usage::

    report = check_model(CheckSpec("mypkg:make_unet", None, InputSpec((1, 1, 32, 32))))   # local ranks
    report = check_model(spec, runner=lambda world, fn, *args: ranks.run(world, fn, *args))  # any launcher
    print(report.table()); report.equal; report.degenerate; report.passed
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


from mesh3d.domain.probe import downsampling_factor
from mesh3d.planner.check import CheckSpec, check_on_rank
from mesh3d.planner.exercise import Exercise
from mesh3d.planner.job import plan_job
from mesh3d.planner.launch import LocalRanks
from mesh3d.mesh_shape import JobMesh
from mesh3d.planner.simulate import InputSpec
from mesh3d.planner.spec import load_model_factory, load_plan
from mesh3d.meta_builds import built_on_meta

__all__ = ["CheckReport", "check_model", "default_meshes", "uneven_sizes"]

#: fp64: a parallel result this close to one process's is equal (summation order differs, nothing else).
TOLERANCE = 1e-9

Runner = Callable[..., list[Any]]


def uneven_sizes(length: int, parts: int, multiple: int) -> tuple[int, ...]:
    """A split of ``length`` over ``parts`` ranks that is uneven where it can be, every size but the last a
    multiple of ``multiple`` (the model's downsampling factor, so shapes it compares agree on every rank).

    Usage: ``uneven_sizes(32, 2, 4)  # (20, 12)``; ``uneven_sizes(16, 3, 4)  # (8, 4, 4)``
    """
    units, rest = divmod(length, multiple)
    base = units // parts
    if units % parts == 0 and base > 1:
        base -= 1  # take one unit from every other rank: the first rank holds more
    sizes = [units - base * (parts - 1)] + [base] * (parts - 1)
    sizes = [s * multiple for s in sizes]
    sizes[-1] += rest
    return tuple(sizes)


def default_meshes(has_tp: bool) -> list[JobMesh]:
    """Domain 2, domain 3, batch 2 x domain 2, and model 2 where the plan has tensor parallelism."""
    meshes = [JobMesh(1, (2,), 1), JobMesh(1, (3,), 1), JobMesh(2, (2,), 1)]
    return meshes + [JobMesh(1, (1,), 2)] if has_tp else meshes


@dataclass
class MeshResult:
    """One mesh's verdict: ``equal``, ``DIFFERENT``, ``refused`` or ``error``."""

    mesh: str
    sizes: list[list[int]]
    verdict: str
    diffs: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    checkpoint: str = ""
    exercise: dict[str, Any] = field(default_factory=dict)  # what the one-process reference exercised


@dataclass
class CheckReport:
    """Every mesh's result; ``equal`` when all of them are.

    Usage: ``report = check_model(spec); print(report.table()); report.equal; report.to_json()``
    """

    model: str
    tolerance: float
    meshes: list[MeshResult]
    allow_degenerate: bool = False

    @property
    def equal(self) -> bool:
        return all(m.verdict == "equal" for m in self.meshes)

    @property
    def exercised(self) -> Exercise | None:
        """What the references of the meshes that ran exercised, together (None when none ran)."""
        found = [Exercise(**m.exercise) for m in self.meshes if m.exercise]
        if not found:
            return None
        merged = found[0]
        for other in found[1:]:
            merged = merged.merge(other)
        return merged

    @property
    def degenerate(self) -> bool:
        """The check could have passed whatever the parallel code did (``exercise.py``)."""
        exercised = self.exercised
        return exercised is not None and exercised.degenerate

    @property
    def passed(self) -> bool:
        """Equal on every mesh, and not degenerate unless that was allowed."""
        return self.equal and (self.allow_degenerate or not self.degenerate)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        exercised = self.exercised
        return {**asdict(self), "equal": self.equal, "degenerate": self.degenerate, "passed": self.passed,
                "exercised": exercised.to_json() if exercised is not None else None}

    def _exercise_lines(self) -> list[str]:
        exercised = self.exercised
        if exercised is None or not (exercised.reasons() or exercised.perturbed):
            return []
        lines = []
        if exercised.perturbed:
            lines.append(f"perturbed: {', '.join(exercised.perturbed)} (zero throughout at initialisation) were given "
                         "small random values first, so their gradient paths run (--perturb-zero-init)")
        reasons = exercised.reasons()
        if not reasons:
            return lines + [""]
        lines.append("WARNING: this check exercises little of the model:" if exercised.degenerate else "note:")
        lines += [f"  - {r}" for r in reasons]
        if exercised.degenerate:
            lines.append("  an equal verdict here says little: the parallel run could be wrong in what was not exercised.")
            if exercised.zero_at_init and not exercised.perturbed:
                lines.append(f"  {', '.join(exercised.zero_at_init)} are zero throughout at initialisation: rerun with "
                             "--perturb-zero-init to give them small random values (the same on every rank and in the "
                             "reference), or pass --allow-degenerate to accept this check as it is.")
            else:
                lines.append("  give the model's parameters values that make every one of them matter (check_model "
                             "takes a factory: wrap yours), or pass --allow-degenerate to accept this check as it is.")
        return lines + [""]

    def table(self) -> str:
        """The verdict table, then the largest relative difference of each tensor on each mesh, then refusals."""
        lines = [f"check of {self.model} against one process (float64, equal: every difference <= {self.tolerance:g})", ""]
        head = ["mesh", "sizes", "output", "loss", "worst gradient", "checkpoint", "verdict"]
        rows = []
        # NOTE: a degenerate check's rows never say plain "equal": the numbers compare what little was exercised.
        mark = "" if not self.degenerate else " (accepted degenerate)" if self.allow_degenerate else ", DEGENERATE"
        for m in self.meshes:
            grads = {k: v for k, v in m.diffs.items() if k.startswith("grad ")}
            worst = max(grads, key=grads.__getitem__, default=None)
            rows.append([m.mesh, "/".join(",".join(map(str, s)) for s in m.sizes), _num(m.diffs.get("output")),
                         _num(m.diffs.get("loss")), f"{_num(grads[worst])} ({worst[5:]})" if worst else "-",
                         m.checkpoint or "-", m.verdict + (mark if m.verdict == "equal" else "")])
        lines += _aligned(head, rows) + [""]
        names = list(dict.fromkeys(k for m in self.meshes for k in m.diffs))
        if names:
            lines += ["largest relative difference per tensor"]
            lines += _aligned(["tensor"] + [m.mesh for m in self.meshes],
                              [[n] + [_num(m.diffs.get(n)) for m in self.meshes] for n in names]) + [""]
        for m in self.meshes:
            lines += [f"{m.mesh}: {op} would be refused: {msg}" for op, msg in m.refused.items()]
            lines += [f"{m.mesh}: {e}" for e in m.errors]
        lines += self._exercise_lines()
        if not self.equal:
            lines.append("verdict: NOT equal: see the table")
        elif self.degenerate:
            lines.append("verdict: EQUAL on every mesh, but DEGENERATE: see the warning"
                         + (" (accepted: --allow-degenerate)" if self.allow_degenerate else ""))
        else:
            lines.append("verdict: EQUAL on every mesh")
        return "\n".join(lines)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def _aligned(head: list[str], rows: list[list[str]]) -> list[str]:
    cells = [head] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _sizes(spec: CheckSpec, mesh: JobMesh) -> tuple[tuple[int, ...], ...]:
    if spec.inputs.sizes is not None and len(spec.inputs.sizes[0]) == mesh.domain:
        return spec.inputs.sizes
    if mesh.domain == 1:
        return ()
    if spec.graph is not None:  # nodes: uneven, no alignment
        return (uneven_sizes(spec.inputs.shape[spec.node_dim()], mesh.domain, 1),)
    dims = spec.inputs.dims if spec.inputs.dims is not None else tuple(range(2, 2 + len(mesh.grid)))
    with built_on_meta():
        model = load_model_factory(spec.model)()
    out = []
    for d, g in zip(dims, mesh.grid):
        try:
            factor = downsampling_factor(model, spec.inputs.shape, d, None if spec.inputs.dtype.is_floating_point
                                         else spec.inputs.dtype)
        except Exception:  # noqa: BLE001 - a model the probe cannot run: no alignment (the run will say why)
            factor = 1
        out.append(uneven_sizes(spec.inputs.shape[d], g, factor))
    return tuple(out)


def _mesh_run(spec: CheckSpec, mesh: JobMesh, runner: Runner, save_to: str | None, load_from: str | None,
              tolerance: float) -> MeshResult:
    sizes = _sizes(spec, mesh)
    result = MeshResult(mesh.short(), [list(s) for s in sizes], "equal")
    inputs = InputSpec(spec.inputs.shape, spec.inputs.dtype, spec.inputs.dims, sizes if mesh.domain > 1 else None)
    try:
        if spec.graph is None:  # NOTE: a graph model's dry run on meta tensors is not modeled (docs/plan.md)
            job = plan_job(load_model_factory(spec.model), load_plan(spec.plan), mesh, inputs, optimizer="none")
            result.refused = dict(job.refused)
    except ValueError as err:
        result.verdict, result.errors = "error", [str(err)]
        return result
    if result.refused:
        result.verdict = "refused"
        return result
    per_rank = runner(mesh.world, check_on_rank, spec, mesh, sizes, save_to, load_from)
    result.errors = sorted({f"rank {r}: {res['error']}" for r, res in enumerate(per_rank) if res["status"] != "ok"})
    if result.errors:
        result.verdict = "error"
        return result
    result.exercise = per_rank[0].get("exercise", {})
    for res in per_rank:
        for name, value in res["diffs"].items():
            result.diffs[name] = max(result.diffs.get(name, 0.0), value)
    if any(not math.isfinite(v) or v > tolerance for v in result.diffs.values()):
        result.verdict = "DIFFERENT"
    if save_to is not None:
        result.checkpoint = f"saved ({per_rank[0]['saved']} tensors)"
    if load_from is not None:
        bad = sorted({k for res in per_rank for k in res["mismatched"]})
        result.checkpoint = f"loaded bitwise ({per_rank[0]['loaded']} tensors)" if not bad else f"{len(bad)} differ"
        if bad:
            result.verdict = "DIFFERENT"
            result.errors.append(f"after loading the checkpoint saved on another mesh, these differ: {', '.join(bad[:8])}")
    return result


def check_model(spec: CheckSpec, meshes: list[JobMesh] | None = None, runner: Runner | None = None,
                tolerance: float = TOLERANCE, workdir: str | None = None, allow_degenerate: bool = False) -> CheckReport:
    """Check ``spec`` on ``meshes`` (see the module docstring); ``runner(world, fn, *args)`` runs ``fn`` on that many
    ranks and returns their results (default: local gloo ranks, started once for every mesh).

    Usage: ``print(check_model(CheckSpec("mypkg:make_unet", None, InputSpec((1, 1, 32, 32)))).table())``
    """
    plan = load_plan(spec.plan)
    meshes = meshes if meshes is not None else default_meshes(bool(plan.model))
    workdir = workdir or tempfile.mkdtemp(prefix="mesh3d-check-")
    local: list[LocalRanks] = []

    def run_locally(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not local:  # started at the first mesh that runs, once, as large as the largest mesh
            local.append(LocalRanks(max(m.world for m in meshes)))
        return local[0].run(world, fn, *args)

    results: list[MeshResult] = []
    saved: str | None = None
    try:
        for i, mesh in enumerate(meshes):
            target = os.path.join(workdir, f"mesh{i}")
            result = _mesh_run(spec, mesh, runner or run_locally, target if saved is None else None, saved, tolerance)
            if saved is None and result.checkpoint.startswith("saved"):
                saved = target
            results.append(result)
    finally:
        for ranks in local:
            ranks.close()
    name = spec.model if isinstance(spec.model, str) else getattr(spec.model, "__qualname__", "model")
    return CheckReport(name, tolerance, results, allow_degenerate)
