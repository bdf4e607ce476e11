"""What each ``mesh3d`` subcommand takes: its help line, its arguments, and where the function that runs it lives.

Nothing here imports torch: the parser is built from this module alone, so ``mesh3d --help``, ``--version`` and a
subcommand's ``--help`` answer at once; the module that runs a command is imported when that command runs.

Usage::

    for name, command in COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help))
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["COMMANDS", "Command", "add_check_arguments", "add_ckpt_arguments", "add_explain_arguments",
           "add_forecast_arguments", "add_plan_arguments", "add_score_arguments", "input_arguments"]


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="module:factory that returns the nn.Module (built on the meta device)")
    parser.add_argument("plan", help="module:name of a mesh3d.Plan, or of a function returning one")
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


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    input_arguments(parser)
    parser.add_argument("--meshes", nargs="+", metavar="MESH", help="meshes BATCH,DOMAIN,MODEL to check on (default: "
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


def add_forecast_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:FACTORY", help="a function returning the model (package.module:name or file.py:name)")
    p.add_argument("checkpoint", help="a mesh3d checkpoint directory (saved on any mesh)")
    p.add_argument("dataset", help="the initial conditions (and truth): a zarr v3 store or NetCDF4/HDF5 file")
    p.add_argument("--out", required=True, help="the forecast store (zarr); an existing one of the same run is continued")
    p.add_argument("--init", required=True, type=_inits, help="init times: datetimes (2020-01-14T00) or time indices, "
                   "comma-separated")
    p.add_argument("--leads", required=True, type=int, help="lead times to forecast (model steps)")
    p.add_argument("--members", type=int, default=1, help="ensemble members per init time (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the ensemble's seed (a member depends on it, never on the mesh)")
    p.add_argument("--perturb", default=None, help="initial perturbation: a Gaussian scale in normalized units, one per "
                   "channel, or a function module:name taking (x, noise)")
    p.add_argument("--model-noise", action="store_true", help="the model draws its own noise: it is called as model(x, noise)")
    p.add_argument("--channels", nargs="+", default=None, metavar="VAR[:LEVELS]",
                   help="channels, e.g. z:500 t:850 t2m (default: the checkpoint's extra['weather'])")
    p.add_argument("--stats", default=None, help="normalization JSON {'mean': [...], 'std': [...]} (default: the checkpoint's)")
    p.add_argument("--lead", type=_hours, default=None, help="the model's step, e.g. 6h (default: the checkpoint's)")
    for axis, default in (("batch", "-1"), ("domain", "1"), ("model", "1")):
        p.add_argument(f"--{axis}", dest=f"{axis}_axis", default=default,
                       help=f"{axis} axis size{' (a grid such as 2x2 splits lat x lon)' if axis == 'domain' else ''} "
                            f"(default {default})")
    p.add_argument("--plan", default=None, help="a Plan splitting the weights over the model axis (module:name; batch=None)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per model call on each batch rank (default 1)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None, help="cast the model (default: "
                   "the checkpoint's)")
    p.add_argument("--store-dtype", choices=("float32", "float64"), default=None, help="the store's dtype (default: the model's)")
    p.add_argument("--no-compress", action="store_true", help="store raw bytes (default: zstd, zarr's default codec)")
    p.add_argument("--tile", type=_tile, default=None, help="the store's chunk tile LATxLON (default: 8 x 8 tiles)")
    p.add_argument("--restart-every", type=int, default=1, help="keep the state every n leads for a resume (0: recompute)")
    p.add_argument("--scores", default=None, metavar="DIR", help="score the store and write scores.csv/.json/.png here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="a forecast store written by mesh3d forecast")
    p.add_argument("--out", required=True, metavar="DIR", help="where scores.csv, scores.json and scores.png go")
    p.add_argument("--dataset", default=None, help="the truth (default: the dataset the forecast read)")
    for axis, default in (("batch", "-1"), ("domain", "1")):
        p.add_argument(f"--{axis}", dest=f"{axis}_axis", default=default, help=f"{axis} axis size (default {default})")


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, what adds its arguments, and ``"module:function"`` that runs it (``args`` in,
    the exit status out)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: str


COMMANDS: dict[str, Command] = {
    "info": Command("print the environment: torch, backends, devices, launcher", lambda p: None,
                    "mesh3d.environment:run_info"),
    "explain": Command("print what a parallelize Plan does to each module of a model: placements and bytes per rank",
                       add_explain_arguments, "mesh3d.cli_run:run_explain"),
    "ckpt": Command("inspect, verify or coalesce (to Hugging Face safetensors) a mesh3d checkpoint", add_ckpt_arguments,
                    "mesh3d.checkpoint.cli:run"),
    "plan": Command("size a job before it runs: memory, communication and checkpoint files per class of ranks, on one "
                    "CPU", add_plan_arguments, "mesh3d.planner.cli:run_plan"),
    "check": Command("run a model and plan on small uneven meshes of local gloo ranks against one process, in fp64",
                     add_check_arguments, "mesh3d.planner.cli:run_check"),
    "forecast": Command("an ensemble weather forecast from a checkpoint on any mesh, each rank writing its block of one "
                        "zarr store (resumes a killed run)", add_forecast_arguments,
                        "mesh3d.weather.cli:run_forecast_command"),
    "score": Command("RMSE, fair CRPS, spread/skill and ACC of a forecast store against its dataset, per channel and "
                     "lead", add_score_arguments, "mesh3d.weather.cli:run_score_command"),
}
