"""Benchmark ``mesh3d plan`` at 4096 ranks, against simulating every domain rank, and check its scaling.

Usage::

    python scripts/bench_plan.py                      # ~1-2 min on 2 cores
    python scripts/bench_plan.py --repeats 1 --out /tmp/plan.json      # a smoke run

Two jobs of 4096 ranks, planned on one CPU with no process group (the worked examples of docs/plan.md):

- a Llama-8B-shaped decoder on a 3-D mesh, batch 32 x domain 16 x model 8, 128 Ki tokens a sample;
- a 3-D U-Net 32 features wide on a 4x4x4 domain grid, batch 64, 512^3 voxels, HSDP.

For each: the median wall and CPU time of ``plan_job`` (goal: under 10 s), the number of ranks simulated,
the time of the same plan with every block of a deep stack simulated (``splice_blocks=False``: what splicing
saves, ``mesh3d.planner.repeat``; its figures must be equal, and are checked here) and the time of the
alternative that keys no classes: simulating every domain rank (what the classes save; the model and batch axes
need no simulation of their own either way). Then the documented ``mesh3d plan`` command for the decoder, end to
end through the console script (imports included; goal: at most 5 s). Then the scaling check:
bytes per rank against the shard degree, which must fall as 1/degree where the plan shards (parameters,
gradients and optimizer state over FSDP's degree; the input over the domain), and the U-Net's step peak
over the domain (activations 1/D plus halos). Writes docs/benchmarks/plan.json and plan.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples"))
from bench_common import cpu_model  # noqa: E402

from mesh3d import Plan  # noqa: E402
from mesh3d.planner import InputSpec, JobMesh, plan_job  # noqa: E402
from mesh3d.planner.fanout import default_workers  # noqa: E402
from mesh3d.planner.layout import ModelLayout  # noqa: E402
from mesh3d.planner.repeat import SplicedSimulation  # noqa: E402
from mesh3d.planner.simulate import Simulator  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "plan.json"


def _jobs():
    from llama_decoder import PLAN, llama_8b
    from volume_unet3d import HSDP, unet3d_wide

    return {
        "llama-8B, 128 Ki tokens, batch 32 x domain 16 x model 8": (
            llama_8b, PLAN, JobMesh.resolve(4096, 32, 16, 8), InputSpec((1, 131072), torch.int64, (1,)),
            JobMesh.parse("64,8,8")),
        "3-D U-Net, 512^3 voxels, batch 64 x domain 4x4x4 (HSDP)": (
            unet3d_wide, HSDP, JobMesh.resolve(4096, 64, (4, 4, 4), 1), InputSpec((1, 1, 512, 512, 512)),
            JobMesh.parse("128,4x4x2,1")),
    }


def _every_domain_rank(factory, plan, mesh, inputs, spliced: bool) -> float:
    """Seconds to simulate every domain rank (what planning without classes would cost), each as the plan did:
    spliced from a few blocks where it spliced."""
    with torch.device("meta"):
        model = factory()
    start = time.perf_counter()
    if spliced:
        sim = SplicedSimulation.build(model, plan, mesh, inputs, "cuda", None)
        assert sim is not None
    else:
        sim = Simulator(model, plan, ModelLayout.build(model, plan, mesh), inputs)
    for d in range(mesh.domain):
        sim.run(d)
    sim.close()
    return time.perf_counter() - start


def _figures(job) -> dict:
    """A plan's report less its timing and how it was simulated (what splicing must leave equal)."""
    report = job.to_json()
    for key in ("seconds", "spliced"):
        report.pop(key)
    return report


def _command_seconds(repeats: int) -> dict[str, float]:
    """Median wall seconds of docs/plan.md's llama_8b command through the installed console script: as a user runs it
    (the domain classes simulated on this machine's cores) and with ``--workers 1`` (one process), alternating."""
    command = [str(Path(sys.executable).with_name("mesh3d")), "plan", "examples/llama_decoder.py:llama_8b",
               "--world", "4096", "--batch", "32", "--domain", "16", "--model", "8", "--input", "1x131072",
               "--dtype", "int64", "--shard-dims", "1", "--plan", "examples/llama_decoder.py:PLAN",
               "--device-memory", "80GiB"]
    walls: dict[str, list[float]] = {"default": [], "one_worker": []}
    for _ in range(repeats):
        for key, extra in (("default", []), ("one_worker", ["--workers", "1"])):
            start = time.perf_counter()
            subprocess.run(command + extra, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=600)
            walls[key].append(time.perf_counter() - start)
    return {key: statistics.median(w) for key, w in walls.items()}


def _scaling(factory, plan_of, meshes, inputs_of) -> list[dict]:
    rows = []
    for degree, mesh in meshes:
        job = plan_job(factory, plan_of(degree), mesh, inputs_of(degree))
        worst = max(job.classes, key=lambda c: c.memory["peak"])
        rows.append({"degree": degree, **{k: worst.memory[k] for k in ("params", "grads", "optimizer", "input", "step_peak")}})
    base = rows[0]
    for row in rows:
        row["ratio_x_degree"] = {k: row[k] * row["degree"] / base[k] / base["degree"] if base[k] else None
                                 for k in ("params", "grads", "optimizer", "input", "step_peak")}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {"machine": cpu_model(), "torch": torch.__version__, "jobs": {}, "load_average_before": os.getloadavg()[0]}
    for name, (factory, plan, mesh, inputs, to) in _jobs().items():
        walls, cpus = [], []
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            job = plan_job(factory, plan, mesh, inputs, to=to, device_memory=80 * 2**30)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        whole_walls = []
        for _ in range(args.repeats if job.spliced else 0):
            wall = time.perf_counter()
            whole = plan_job(factory, plan, mesh, inputs, to=to, device_memory=80 * 2**30, splice_blocks=False)
            whole_walls.append(time.perf_counter() - wall)
            if _figures(whole) != _figures(job):
                raise SystemExit(f"{name}: the spliced plan's figures differ from every block simulated")
        every = _every_domain_rank(factory, plan, mesh, inputs, bool(job.spliced))
        simulate_share = every / mesh.domain * job.simulated_ranks
        report["jobs"][name] = {"ranks": mesh.world, "classes": len(job.classes), "simulated": job.simulated_ranks,
                                "spliced": job.spliced, "domain_ranks": mesh.domain, "wall_s": statistics.median(walls),
                                "cpu_s": statistics.median(cpus),
                                "every_block_s": statistics.median(whole_walls) if whole_walls else None,
                                "every_domain_rank_s": every,
                                "classes_s": simulate_share, "peak_bytes": max(c.memory["peak"] for c in job.classes)}
        print(f"{name}: {statistics.median(walls):.2f} s wall, {statistics.median(cpus):.2f} s CPU, {len(job.classes)} "
              f"classes, {job.simulated_ranks} of {mesh.domain} domain ranks simulated ({job.spliced or 'every block'}); "
              f"every block: {report['jobs'][name]['every_block_s']}; every domain rank: {every:.2f} s", flush=True)
    command = _command_seconds(args.repeats)
    report["command_s"], report["command_one_worker_s"] = command["default"], command["one_worker"]
    report["command_workers"] = default_workers()
    print(f"mesh3d plan (the documented llama_8b command, console script): {report['command_s']:.2f} s; "
          f"with --workers 1: {report['command_one_worker_s']:.2f} s", flush=True)
    from llama_decoder import PLAN, llama_8b
    from volume_unet3d import unet3d_wide

    report["fsdp_scaling"] = _scaling(llama_8b, lambda s: PLAN,
                                      [(s, JobMesh.resolve(8 * s, s, 1, 8)) for s in (1, 8, 64, 512)],
                                      lambda s: InputSpec((1, 131072), torch.int64, (1,)))
    report["domain_scaling"] = _scaling(unet3d_wide, lambda d: Plan(batch=None),
                                        [(d, JobMesh.resolve(d, 1, g, 1)) for d, g in ((1, 1), (8, (2, 2, 2)), (64, (4, 4, 4)))],
                                        lambda d: InputSpec((1, 1, 256, 256, 256)))
    for key in ("fsdp_scaling", "domain_scaling"):
        for row in report[key]:
            print(key, row["degree"], {k: (round(v, 3) if v is not None else None) for k, v in row["ratio_x_degree"].items()})
    report["load_average_after"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "fsdp_scaling", "FSDP degree (llama-8B, model 8)"),
                           (axes[1], "domain_scaling", "domain ranks (3-D U-Net, 256^3)")):
        rows = report[key]
        degrees = [r["degree"] for r in rows]
        for field in ("params", "optimizer", "input", "step_peak"):
            if rows[0][field]:
                ax.loglog(degrees, [r[field] for r in rows], marker="o", label=field)
        ax.loglog(degrees, [rows[0]["params" if key == "fsdp_scaling" else "input"] / d for d in degrees], "k:",
                  label="1/degree")
        ax.set_xlabel(label)
        ax.set_ylabel("bytes per rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
