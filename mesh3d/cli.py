"""The ``mesh3d`` command line.

Usage::

    mesh3d --version
    mesh3d info            # torch version, backends, devices and the launcher this process sees
    mesh3d explain pkg.mod:make_model pkg.mod:plan --batch 2 --model 2
    mesh3d ckpt inspect|verify|coalesce PATH [OUT]
    mesh3d plan pkg.mod:make_model --world 4096 --domain 4x4 --model 4 --input 1x1x512x512 [--json]
    mesh3d check pkg.mod:make_model --input 1x1x32x32 [--plan pkg.mod:plan] [--meshes 1,2,1 2,2,1]
    mesh3d forecast pkg.mod:make_model CKPT DATASET --out fc.zarr --init 40,44 --leads 10 --members 8 [--scores DIR]
    mesh3d score fc.zarr --out DIR
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import mesh3d
from mesh3d.checkpoint import cli as ckpt_cli
from mesh3d.launcher import detect_launcher
from mesh3d.parallel.explain import explain_table
from mesh3d.parallel.plan import Plan
from mesh3d.planner import cli as planner_cli
from mesh3d.weather import cli as forecast_cli

__all__ = ["main", "build_parser", "environment_report", "TESTED_TORCH"]

#: The oldest and newest torch mesh3d is tested on (pyproject's floor is the first). 2.13.0 is the
#: local CPU wheel CI uses; 2.14.1 (a CUDA build, run on the CPU) installs from this machine's wheel
#: cache: ``TORCH_PIN=torch==2.14.1 MESH3D_VENV=.venv-214 scripts/test.sh``. Older releases would be
#: multi-GB CUDA downloads here, so they are not claimed.
TESTED_TORCH: tuple[str, str] = ("2.13.0", "2.14.1")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def environment_report() -> dict[str, str]:
    """What ``mesh3d info`` prints, as ordered key/value pairs."""
    backends = [name for name in ("gloo", "nccl", "mpi", "ucc") if getattr(dist, f"is_{name}_available", lambda: False)()]
    try:
        info = detect_launcher()
        launcher = f"{info.launcher} (rank {info.rank} of {info.world_size}, local rank {info.local_rank})"
        if info.master_addr:
            launcher += f", rendezvous {info.master_addr}:{info.master_port}"
    except ValueError as err:
        launcher = f"misconfigured: {err}"
    cuda = torch.cuda.is_available()
    low, high = TESTED_TORCH
    inside = _release(low) <= _release(torch.__version__) <= _release(high)
    return {
        "mesh3d": mesh3d.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "tested torch": f"{low} to {high} ({'this one is inside' if inside else 'this one is OUTSIDE'} the tested range)",
        "distributed": "available" if dist.is_available() else "unavailable",
        "backends": ", ".join(backends) or "none",
        "cuda": f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}" if cuda else "not available",
        "default backend": "nccl" if cuda else "gloo",
        "launcher": launcher,
    }


def _cmd_info(args: argparse.Namespace) -> int:
    report = environment_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")
    return 0


def load_object(spec: str) -> object:
    """``"package.module:name"`` → that object (``name`` may be dotted)."""
    if ":" not in spec:
        raise ValueError(f"{spec!r} must look like 'package.module:name'")
    module_name, attr = spec.split(":", 1)
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="module:factory that returns the nn.Module (built on the meta device)")
    parser.add_argument("plan", help="module:name of a mesh3d.Plan, or of a function returning one")
    for axis in ("batch", "domain", "model"):
        parser.add_argument(f"--{axis}", dest=f"size_{axis}", type=int, default=1, help=f"{axis} axis size")


def _cmd_explain(args: argparse.Namespace) -> int:
    """``mesh3d explain pkg.mod:make_model pkg.mod:plan --batch 2 --model 2``."""
    factory = load_object(args.model)
    with torch.device("meta"):
        model = factory()
    plan = load_object(args.plan)
    if not isinstance(plan, Plan):
        plan = plan()
    if not isinstance(plan, Plan):
        raise TypeError(f"{args.plan} must be a mesh3d.Plan or a function returning one, got {type(plan).__name__}")
    sizes = {"batch": args.size_batch, "domain": args.size_domain, "model": args.size_model}
    print(explain_table(plan, model, sizes))
    return 0


#: Subcommands register here: name -> (help, add_arguments, run).
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "info": ("print the environment: torch, backends, devices, launcher", lambda p: None, _cmd_info),
    "explain": (
        "print what a parallelize Plan does to each module of a model: placements and bytes per rank",
        _explain_arguments,
        _cmd_explain,
    ),
    "ckpt": ("inspect, verify or coalesce (to Hugging Face safetensors) a mesh3d checkpoint",
             ckpt_cli.add_arguments, ckpt_cli.run),
    "plan": ("size a job before it runs: memory, communication and checkpoint files per class of ranks, on one CPU",
             planner_cli.add_plan_arguments, planner_cli.run_plan),
    "check": ("run a model and plan on small uneven meshes of local gloo ranks against one process, in fp64",
              planner_cli.add_check_arguments, planner_cli.run_check),
    "forecast": ("an ensemble weather forecast from a checkpoint on any mesh, each rank writing its block of one zarr "
                 "store (resumes a killed run)", forecast_cli.add_forecast_arguments, forecast_cli.run_forecast_command),
    "score": ("RMSE, fair CRPS, spread/skill and ACC of a forecast store against its dataset, per channel and lead",
              forecast_cli.add_score_arguments, forecast_cli.run_score_command),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh3d", description="3D-parallel training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"mesh3d {mesh3d.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
