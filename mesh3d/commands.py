"""What each ``mesh3d`` subcommand takes: its help line, its arguments, and where the function that runs it lives.

Nothing here imports torch: the parser is built from this module alone, so ``mesh3d --help``, ``--version`` and a
subcommand's ``--help`` answer at once; the module that runs a command is imported when that command runs.

Usage::

    for name, command in COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help))
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh3d.mesh_shape import JobMesh, parse_grid

__all__ = ["COMMANDS", "Command", "add_check_arguments", "add_ckpt_arguments", "add_explain_arguments",
           "add_forecast_arguments", "add_plan_arguments", "add_score_arguments", "input_arguments", "parse_bytes"]

# NOTE: every argument is checked here, by its argparse type, before torch or the model is imported: a typo answers
# in a fraction of a second, not after the import (a minute on a loaded machine). What needs torch or the model (the
# model's own input layout) is checked by the command itself, still before any process starts.

#: torch's dtype names (``getattr(torch, name)``), listed so the parser needs no torch.
DTYPES = ("float32", "float64", "float16", "bfloat16", "float", "double", "half", "int64", "int32", "int16", "int8",
          "uint8", "long", "int", "short", "bool", "complex64", "complex128")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920; ``"8e10"`` → 80000000000.

    Usage: ``parse_bytes("80GB")``
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    try:
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    except ValueError:
        raise ValueError(f"{text!r} is not an amount of memory; write e.g. 80GiB, 80GB or 8e10") from None


def _checked(parse: Callable[[str], Any], what: str) -> Callable[[str], str]:
    """An argparse type that checks ``text`` with ``parse`` and keeps the text (the command parses it again)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err) if str(err) else f"{text!r} is not {what}") from None
        return text
    check.__name__ = what  # argparse names the type in its message
    return check


def _positive_ints(text: str, sep: str, what: str, example: str) -> tuple[int, ...]:
    parts = text.replace(",", sep).split(sep) if sep == "x" else text.split(sep)
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{text!r} is not {what}: give positive integers, e.g. {example}")
    return tuple(int(p) for p in parts)


def _spec(text: str) -> None:
    module, _, name = text.rpartition(":")
    if not module or not name.isidentifier():
        raise ValueError(f"{text!r} is not MODULE:NAME: give a module or .py file and a name in it, e.g. "
                         "mypkg.models:make_unet or examples/llama_decoder.py:tiny")
    if module.endswith(".py") and not os.path.isfile(module):
        raise ValueError(f"{module!r} does not exist (from {os.getcwd()}): give the path of the .py file, or a module")


def _axis(text: str) -> None:
    value = parse_grid(text)
    if (value != -1 and isinstance(value, int) and value < 1) or (isinstance(value, tuple) and min(value) < 1):
        raise ValueError(f"{text!r} is not an axis size: give a positive integer, -1 (inferred), or a grid such as 2x2")


SHAPE = _checked(lambda t: _positive_ints(t, "x", "a shape", "1x1x64x64"), "a shape")
DIMS = _checked(lambda t: _positive_ints(t, ",", "a list of dims", "2 or 2,3"), "a list of dims")
SIZES = _checked(lambda t: [_positive_ints(p, ",", "rows per rank", "40,24 or 20,12/16,16") for p in t.split("/")],
                 "rows per rank")
MESH = _checked(JobMesh.parse, "a mesh")
AXIS = _checked(_axis, "an axis size")
SPEC = _checked(_spec, "MODULE:NAME")
BYTES = _checked(parse_bytes, "an amount of memory")


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose error is one line: what was wrong, and where to read what is right."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=SPEC, help="module:factory that returns the nn.Module (built on the meta device)")
    parser.add_argument("plan", type=SPEC, help="module:name of a mesh3d.Plan, or of a function returning one")
    for axis in ("batch", "domain", "model"):
        parser.add_argument(f"--{axis}", dest=f"size_{axis}", type=int, default=1, help=f"{axis} axis size")


def add_ckpt_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    p = sub.add_parser("inspect", help="tensors, shapes, chunks, the mesh it was saved on, sizes")
    p.add_argument("path")
    p = sub.add_parser("verify", help="every checksum and full coverage of every tensor")
    p.add_argument("path")
    p = sub.add_parser("coalesce", help="write Hugging Face model.safetensors (+ index above --max-shard-gb)")
    p.add_argument("path")
    p.add_argument("out", help="new output directory")
    p.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bf16, f16, f32 (safetensors names)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split output above this size (default 5)")


def input_arguments(parser: argparse.ArgumentParser, input_required: bool) -> None:
    """The arguments ``plan`` and ``check`` share: the model, its plan and its input."""
    parser.add_argument("model", metavar="MODULE:FACTORY", type=SPEC, help="a function returning the nn.Module (called "
                        "on the meta device for plan); MODULE may be a path to a .py file")
    parser.add_argument("--plan", metavar="MODULE:NAME", type=SPEC, help="a mesh3d.Plan, or a function returning one "
                        "(default: Plan())")
    parser.add_argument("--input", metavar="SHAPE", type=SHAPE, required=input_required,
                        help="one batch rank's input, e.g. 1x1x256x256x256" + (" (with --graph: the node features, "
                        "e.g. 642x4)" if input_required else " (required, unless --graph)"))
    parser.add_argument("--graph", metavar="SPEC", help="a graph job: icosahedral:R, channel:NXxNY or MODULE:FACTORY "
                        "(a mesh3d.graphs.TriMesh or a dict with edge_index); the model is called model(x, edge_index)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, metavar="DTYPE",
                        help="the input's dtype, a torch dtype name (default float32; int64 for token ids)")
    parser.add_argument("--shard-dims", metavar="D[,D]", type=DIMS, help="dims the domain shards (default 2; 2,3 on a "
                        "2-D grid)")
    parser.add_argument("--sizes", metavar="N,N[/N,N]", type=SIZES, help="each domain rank's rows per sharded dim "
                        "(default: torch.chunk)")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks: give a positive integer, e.g. 4096")
    return int(text)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    input_arguments(parser, input_required=False)
    parser.add_argument("--world", type=_positive, help="number of ranks (default: the product of the axis sizes)")
    parser.add_argument("--batch", type=AXIS, default="-1", help="batch axis size (default -1: inferred from --world)")
    parser.add_argument("--domain", type=AXIS, default="1", help="domain axis size, or a grid such as 4x4 or 4x4x4")
    parser.add_argument("--model", type=AXIS, dest="model_axis", default="1", help="model (tensor-parallel) axis size")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "none"))
    parser.add_argument("--to", metavar="MESH", type=MESH, help="plan loading the checkpoint onto this mesh: "
                        "BATCH,DOMAIN,MODEL")
    parser.add_argument("--device-memory", metavar="BYTES", type=BYTES, help="each rank's device memory, e.g. 80GiB: "
                        "the verdict compares the worst class's peak plus the margin with it")
    parser.add_argument("--margin", metavar="BYTES", type=BYTES, help="a fixed margin per rank for what the plan does "
                        "not model, instead of the estimate (CUDA context, NCCL buffers, fragmentation; docs/plan.md)")
    parser.add_argument("--kernels", default="cuda", choices=("cuda", "cpu"),
                        help="whose kernels to model: cuda (cuDNN, cuBLAS, fused attention, the caching allocator; "
                        "default) or cpu (oneDNN, im2col)")
    parser.add_argument("--workers", type=_positive, metavar="N", help="processes simulating the domain classes (default: "
                        "this machine's cores, at most 4; 1 simulates in this process; the figures are the same)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--features", type=int, default=128, help="--graph: features per node row (default 128)")
    parser.add_argument("--layers", type=int, default=16, help="--graph: message-passing layers (default 16)")
    parser.add_argument("--partition", default="hilbert", choices=("hilbert", "metis", "bfs"),
                        help="--graph: how the nodes are partitioned (default: a Hilbert curve over the coordinates)")


def _require_input_unless_graph(args: argparse.Namespace) -> str | None:
    return None if args.input or args.graph else "give --input SHAPE (one batch rank's input), or --graph for a graph job"


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    input_arguments(parser, input_required=True)
    parser.add_argument("--meshes", nargs="+", metavar="MESH", type=MESH, help="meshes BATCH,DOMAIN,MODEL to check on (default: "
                        "1,2,1 1,3,1 2,2,1, and 1,1,2 when the plan has tensor parallelism)")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="largest relative difference counted as equal")
    parser.add_argument("--perturb-zero-init", action="store_true", help="give parameters that are zero throughout at "
                        "initialisation (a zero-initialised head) small random values first, so every parameter's "
                        "gradient is checked")
    parser.add_argument("--allow-degenerate", action="store_true", help="exit 0 even when the check exercises little "
                        "of the model (the output ignores or is the input, most gradients are exactly zero)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _inits(text: str) -> list[Any]:
    return [int(t) if t.lstrip("-").isdigit() else t for t in text.split(",") if t]


def _hours(text: str) -> int:
    value = text.lower().removesuffix("h")
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a lead time in whole hours (e.g. 6h)")
    return int(value)


def _tile(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tile: give LATxLON points, e.g. 91x180")
    return int(parts[0]), int(parts[1])


def _member_range(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) >= int(parts[1]):
        raise argparse.ArgumentTypeError(f"{text!r} is not a member range: give START:STOP with START < STOP, e.g. 0:10")
    return int(parts[0]), int(parts[1])


def add_forecast_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:FACTORY", type=SPEC, help="a function returning the model "
                   "(package.module:name or file.py:name)")
    p.add_argument("checkpoint", help="a mesh3d checkpoint directory (saved on any mesh)")
    p.add_argument("dataset", help="the initial conditions (and truth): a zarr v3 store or NetCDF4/HDF5 file")
    p.add_argument("--out", required=True, help="the forecast store (zarr); an existing one of the same run is continued")
    p.add_argument("--init", required=True, type=_inits, help="init times: datetimes (2020-01-14T00) or time indices, "
                   "comma-separated")
    p.add_argument("--leads", required=True, type=int, help="lead times to forecast (model steps)")
    p.add_argument("--members", type=int, default=1, help="ensemble members per init time (default 1)")
    p.add_argument("--member-range", type=_member_range, default=None, metavar="START:STOP",
                   help="run members START..STOP-1 of the --members only: jobs of disjoint ranges write one store, "
                        "equal to one job's (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the ensemble's seed (a member depends on it, never on the mesh)")
    p.add_argument("--perturb", default=None, help="initial perturbation: a Gaussian scale in normalized units, one per "
                   "channel, or a function module:name taking (x, noise)")
    p.add_argument("--model-noise", action="store_true", help="the model draws its own noise: it is called as model(x, noise)")
    p.add_argument("--channels", nargs="+", default=None, metavar="VAR[:LEVELS]",
                   help="channels, e.g. z:500 t:850 t2m (default: the checkpoint's extra['weather'])")
    p.add_argument("--stats", default=None, help="normalization JSON {'mean': [...], 'std': [...]} (default: the checkpoint's)")
    p.add_argument("--lead", type=_hours, default=None, help="the model's step, e.g. 6h (default: the checkpoint's)")
    for axis, default in (("batch", "-1"), ("domain", "1"), ("model", "1")):
        p.add_argument(f"--{axis}", dest=f"{axis}_axis", default=default, type=AXIS,
                       help=f"{axis} axis size{' (a grid such as 2x2 splits lat x lon)' if axis == 'domain' else ''} "
                            f"(default {default})")
    p.add_argument("--plan", default=None, type=SPEC, help="a Plan splitting the weights over the model axis "
                   "(module:name; batch=None)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per model call on each batch rank (default 1)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None, help="cast the model (default: "
                   "the checkpoint's)")
    p.add_argument("--store-dtype", choices=("float32", "float64"), default=None, help="the store's dtype (default: the model's)")
    p.add_argument("--no-compress", action="store_true", help="store raw bytes (default: zstd, zarr's default codec)")
    p.add_argument("--tile", type=_tile, default=None, help="the store's chunk tile LATxLON (default: 8 x 8 tiles)")
    p.add_argument("--convention", choices=("cf", "weatherbench2", "earth2studio"), default="cf",
                   help="the store's names: cf (init_time, lead_time, member; a variable per field), weatherbench2 "
                        "(time, prediction_timedelta, realization), earth2studio (a variable per channel over time, "
                        "lead_time, ensemble, lat, lon) (default cf)")
    p.add_argument("--restart-every", type=int, default=1, help="keep the state every n leads for a resume (0: recompute)")
    p.add_argument("--scores", default=None, metavar="DIR", help="score the store and write scores.csv/.json/.png here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="a forecast store written by mesh3d forecast")
    p.add_argument("--out", required=True, metavar="DIR", help="where scores.csv, scores.json and scores.png go")
    p.add_argument("--dataset", default=None, help="the truth (default: the dataset the forecast read)")
    p.add_argument("--climatology", default=None, metavar="PATH", help="ACC's climatology: a zarr store or NetCDF file "
                   "with one variable per channel (z500, t2m, ...), each a field on the forecast's grid or one value "
                   "(default: the normalization means)")
    p.add_argument("--region", dest="regions", action="append", default=None, metavar="REGION", help="a region to "
                   "score over, repeatable: a name (global, tropics, extratropics_north, extratropics_south, arctic, "
                   "antarctic, europe, north_america) or a box NAME=SOUTH:NORTH,WEST:EAST in degrees (default: global)")
    p.add_argument("--metrics", default=None, metavar="LIST", help="comma-separated metrics to report (default all: "
                   "rmse, crps, spread, spread_skill, acc, member_rmse, member_mae)")
    for axis, default in (("batch", "-1"), ("domain", "1")):
        p.add_argument(f"--{axis}", dest=f"{axis}_axis", default=default, type=AXIS,
                       help=f"{axis} axis size (default {default})")


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, what adds its arguments, and ``"module:function"`` that runs it (``args`` in,
    the exit status out)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: str
    #: What the parser cannot say alone (arguments that need each other): an error message, or None.
    check: Callable[[argparse.Namespace], str | None] = lambda args: None
    #: ``"module:function"`` (no torch) called before ``run``'s module is imported: work to start beside those imports.
    prepare: str | None = None


COMMANDS: dict[str, Command] = {
    "info": Command("print the environment: torch, backends, devices, launcher", lambda p: None,
                    "mesh3d.environment:run_info"),
    "explain": Command("print what a parallelize Plan does to each module of a model: placements and bytes per rank",
                       add_explain_arguments, "mesh3d.cli_run:run_explain"),
    "ckpt": Command("inspect, verify or coalesce (to Hugging Face safetensors) a mesh3d checkpoint", add_ckpt_arguments,
                    "mesh3d.checkpoint.cli:run"),
    "plan": Command("size a job before it runs: memory, communication and checkpoint files per class of ranks, on one "
                    "CPU", add_plan_arguments, "mesh3d.planner.cli:run_plan", _require_input_unless_graph),
    "check": Command("run a model and plan on small uneven meshes of local gloo ranks against one process, in fp64",
                     add_check_arguments, "mesh3d.planner.cli:run_check", prepare="mesh3d.forkserver:start"),
    "forecast": Command("an ensemble weather forecast from a checkpoint on any mesh, each rank writing its block of one "
                        "zarr store (resumes a killed run)", add_forecast_arguments,
                        "mesh3d.weather.cli:run_forecast_command"),
    "score": Command("RMSE, fair CRPS, spread/skill and ACC of a forecast store against its dataset, per channel and "
                     "lead", add_score_arguments, "mesh3d.weather.cli:run_score_command"),
}
