"""``mesh3d plan`` and ``mesh3d check`` on the command line.

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
import re
import sys

import torch

from mesh3d.planner.check import CheckSpec
from mesh3d.planner.check_run import check_model
from mesh3d.planner.graph_job import load_graph, plan_graph
from mesh3d.planner.job import plan_job
from mesh3d.planner.mesh import JobMesh, parse_grid
from mesh3d.planner.simulate import InputSpec
from mesh3d.planner.spec import load_plan, load_spec

__all__ = ["add_check_arguments", "add_plan_arguments", "input_arguments", "parse_bytes", "parse_input", "run_check",
           "run_plan"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920; ``"8e10"`` → 80000000000.

    Usage: ``parse_bytes("80GB")``
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not an amount of memory; write e.g. 80GiB, 80GB or 8e10")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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


def input_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments ``plan`` and ``check`` share: the model, its plan and its input."""
    parser.add_argument("model", metavar="MODULE:FACTORY", help="a function returning the nn.Module (called on the meta "
                        "device for plan); MODULE may be a path to a .py file")
    parser.add_argument("--plan", metavar="MODULE:NAME", help="a mesh3d.Plan, or a function returning one (default: Plan())")
    parser.add_argument("--input", metavar="SHAPE", help="one batch rank's input, e.g. 1x1x256x256x256 (required; for "
                        "--graph of check: the node features, e.g. 642x4)")
    parser.add_argument("--graph", metavar="SPEC", help="a graph job: icosahedral:R, channel:NXxNY or MODULE:FACTORY "
                        "(a mesh3d.graphs.TriMesh or a dict with edge_index); the model is called model(x, edge_index)")
    parser.add_argument("--dtype", default="float32", help="the input's dtype (default float32; int64 for token ids)")
    parser.add_argument("--shard-dims", metavar="D[,D]", help="dims the domain shards (default 2; 2,3 on a 2-D grid)")
    parser.add_argument("--sizes", metavar="N,N[/N,N]", help="each domain rank's rows per sharded dim (default: torch.chunk)")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    input_arguments(parser)
    parser.add_argument("--world", type=int, help="number of ranks (default: the product of the axis sizes)")
    parser.add_argument("--batch", default="-1", help="batch axis size (default -1: inferred from --world)")
    parser.add_argument("--domain", default="1", help="domain axis size, or a grid such as 4x4 or 4x4x4")
    parser.add_argument("--model", dest="model_axis", default="1", help="model (tensor-parallel) axis size")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "none"))
    parser.add_argument("--to", metavar="MESH", help="plan loading the checkpoint onto this mesh: BATCH,DOMAIN,MODEL")
    parser.add_argument("--device-memory", metavar="BYTES", help="each rank's device memory, e.g. 80GiB: the verdict "
                        "compares the worst class's peak plus the margin with it")
    parser.add_argument("--margin", metavar="BYTES", help="a fixed margin per rank for what the plan does not model, "
                        "instead of the estimate (CUDA context, NCCL buffers, fragmentation; docs/plan.md)")
    parser.add_argument("--kernels", default="cuda", choices=("cuda", "cpu"),
                        help="whose kernels to model: cuda (cuDNN, cuBLAS, fused attention, the caching allocator; "
                        "default) or cpu (oneDNN, im2col)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--features", type=int, default=128, help="--graph: features per node row (default 128)")
    parser.add_argument("--layers", type=int, default=16, help="--graph: message-passing layers (default 16)")
    parser.add_argument("--partition", default="hilbert", choices=("hilbert", "metis", "bfs"),
                        help="--graph: how the nodes are partitioned (default: a Hilbert curve over the coordinates)")


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
        batch, domain, model = int(args.batch), parse_grid(args.domain), int(args.model_axis)
        world = args.world
        if world is None:
            if -1 in (batch, model) or domain == -1:
                raise ValueError("give --world when an axis size is -1 (inferred)")
            world = batch * (math.prod(domain) if isinstance(domain, tuple) else domain) * model
        mesh = JobMesh.resolve(world, batch, domain, model)
        inputs = parse_input(args.input, args.dtype, args.shard_dims, args.sizes)
        factory = load_spec(args.model)
        plan = load_plan(args.plan)
        job = plan_job(factory, plan, mesh, inputs, optimizer=args.optimizer, to=JobMesh.parse(args.to) if args.to else None,
                       device_memory=parse_bytes(args.device_memory) if args.device_memory else None,
                       device=args.kernels, name=args.model,
                       margin=parse_bytes(args.margin) if args.margin else None)
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(job.to_json(), indent=1) if args.json else job.table())
    return 0


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    input_arguments(parser)
    parser.add_argument("--meshes", nargs="+", metavar="MESH", help="meshes BATCH,DOMAIN,MODEL to check on (default: "
                        "1,2,1 1,3,1 2,2,1, and 1,1,2 when the plan has tensor parallelism)")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="largest relative difference counted as equal")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run_check(args: argparse.Namespace) -> int:
    """``mesh3d check ...``: 0 when every mesh gives the one-process answer, 1 when one does not, 2 for bad arguments."""
    try:
        if not args.input:
            raise ValueError("give --input SHAPE (one batch rank's input; with --graph, the node features NxF)")
        inputs = parse_input(args.input, args.dtype, args.shard_dims, args.sizes)
        meshes = [JobMesh.parse(m) for m in args.meshes] if args.meshes else None
        load_plan(args.plan)  # a bad --plan fails here, before any process starts
        if args.graph:
            load_graph(args.graph)  # a bad --graph fails here too
        spec = CheckSpec(args.model, args.plan, inputs, graph=args.graph)
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = check_model(spec, meshes, tolerance=args.tolerance)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.table())
    return 0 if report.equal else 1
