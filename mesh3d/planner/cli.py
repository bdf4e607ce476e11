"""``mesh3d plan`` and ``mesh3d check`` on the command line (their arguments: ``mesh3d.commands``).

Usage::

    mesh3d plan mypkg.models:make_unet --world 4096 --domain 4x4x4 --model 1 --input 1x1x512x512x512 \\
        --plan mypkg.plans:PLAN --to 64,8x8,1 --device-memory 80GiB [--json]
    mesh3d check mypkg.models:make_unet --input 1x1x32x32 [--plan mypkg.plans:PLAN] [--meshes 1,2,1 2,2,1] [--json]
    mesh3d plan examples/meshgraphnet.py:tiny --graph icosahedral:6 --domain 8 --features 512 --layers 16 --dtype bfloat16
    mesh3d check examples/meshgraphnet.py:tiny --graph icosahedral:2 --input 162x4 --meshes 1,2,1 1,3,1
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from mesh3d.planner.check import CheckSpec
from mesh3d.planner.check_run import check_model, default_meshes
from mesh3d.planner.graph_job import load_graph, plan_graph
from mesh3d.planner.fanout import default_workers
from mesh3d.planner.job import plan_job
from mesh3d.commands import parse_bytes
from mesh3d.mesh_shape import JobMesh, parse_grid
from mesh3d.planner.simulate import InputSpec
from mesh3d.planner.spec import load_model_factory, load_plan, load_spec

__all__ = ["parse_input", "run_check", "run_plan"]

def parse_input(shape: str, dtype: str, dims: str | None, sizes: str | None) -> InputSpec:
    """``--input 1x1x64x64 --dtype float32 --shard-dims 2 --sizes 40,24`` → ``InputSpec`` (sizes: one comma list per
    sharded dim, separated by ``/``).

    Usage: ``parse_input("2x2x32x32", "float32", None, "20,12")``
    """
    try:
        dims_ = tuple(int(v) for v in shape.replace(",", "x").split("x"))
        torch_dtype = getattr(torch, dtype)
        if not isinstance(torch_dtype, torch.dtype):
            raise AttributeError(dtype)
    except (ValueError, AttributeError):
        raise ValueError(f"--input {shape!r} --dtype {dtype!r}: give a shape like 1x1x64x64 and a torch dtype name "
                         "such as float32, bfloat16 or int64") from None
    shard_dims = tuple(int(v) for v in dims.split(",")) if dims else None
    per_dim = tuple(tuple(int(v) for v in part.split(",")) for part in sizes.split("/")) if sizes else None
    return InputSpec(dims_, torch_dtype, shard_dims, per_dim)


def _plan_graph(args: argparse.Namespace) -> int:
    domain = parse_grid(args.domain)
    parts = domain if isinstance(domain, int) else math.prod(domain)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype) or parts < 1:
        raise ValueError(f"--graph needs --domain N (>= 1) and a torch --dtype; got {args.domain!r}, {args.dtype!r}")
    job = plan_graph(load_graph(args.graph), parts, features=args.features, layers=args.layers,
                     dtype_bytes=dtype.itemsize, batch=max(int(args.batch), 1), method=args.partition)
    print(json.dumps(job.to_json(), indent=1) if args.json else job.table())
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """``mesh3d plan ...``: print the tables (or ``--json``); 2 for bad arguments."""
    try:
        if args.graph:
            return _plan_graph(args)
        if not args.input:
            raise ValueError("give --input SHAPE (one batch rank's input), or --graph for a graph job")
        factory = load_spec(args.model)
        batch, domain, model = int(args.batch), parse_grid(args.domain), int(args.model_axis)
        world = args.world
        if world is None:
            if -1 in (batch, model) or domain == -1:
                raise ValueError("give --world N (the batch axis, -1 by default, is inferred from it) or every axis "
                                 "size (--batch B --domain D --model M)")
            world = batch * (math.prod(domain) if isinstance(domain, tuple) else domain) * model
        mesh = JobMesh.resolve(world, batch, domain, model)
        inputs = parse_input(args.input, args.dtype, args.shard_dims, args.sizes)
        plan = load_plan(args.plan)
        job = plan_job(factory, plan, mesh, inputs, optimizer=args.optimizer, to=JobMesh.parse(args.to) if args.to else None,
                       device_memory=parse_bytes(args.device_memory) if args.device_memory else None,
                       device=args.kernels, name=args.model,
                       margin=parse_bytes(args.margin) if args.margin else None,
                       workers=args.workers or default_workers())
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        print(f"mesh3d plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(job.to_json(), indent=1) if args.json else job.table())
    return 0


def run_check(args: argparse.Namespace) -> int:
    """``mesh3d check ...``: 0 when every mesh gives the one-process answer, 1 when one does not, 2 for bad arguments,
    3 when every mesh is equal but the check exercised too little of the model to mean it (``--allow-degenerate``
    accepts that)."""
    try:
        if not args.input:
            raise ValueError("give --input SHAPE (one batch rank's input; with --graph, the node features NxF)")
        inputs = parse_input(args.input, args.dtype, args.shard_dims, args.sizes)
        meshes = [JobMesh.parse(m) for m in args.meshes] if args.meshes else None
        # a bad model, --plan, --graph or input fails here, before any process starts
        load_model_factory(args.model)
        plan = load_plan(args.plan)
        if args.graph:
            load_graph(args.graph)
        else:
            for mesh in meshes or default_meshes(bool(plan.model)):
                inputs.layout(mesh.grid)
        spec = CheckSpec(args.model, args.plan, inputs, perturb_zero_init=args.perturb_zero_init, graph=args.graph)
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        print(f"mesh3d check: error: {err}", file=sys.stderr)
        return 2
    report = check_model(spec, meshes, tolerance=args.tolerance, allow_degenerate=args.allow_degenerate)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.table())
    return 1 if not report.equal else 0 if report.passed else 3
