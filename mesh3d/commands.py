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

__all__ = ["COMMANDS", "Command", "add_check_arguments", "add_ckpt_arguments", "add_explain_arguments",
           "add_plan_arguments", "input_arguments"]


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
    parser.add_argument("--input", required=True, metavar="SHAPE", help="one batch rank's input, e.g. 1x1x256x256x256")
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
}
