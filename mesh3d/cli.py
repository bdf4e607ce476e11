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

The parser comes from ``mesh3d.commands`` (no torch); a command's module is imported when it runs, so
``--version`` and ``--help`` answer without torch, and ``info`` with torch alone (no compiler stack). A bad
argument is one line on stderr (``mesh3d plan: error: ...``) and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import mesh3d
from mesh3d.commands import COMMANDS, Parser

__all__ = ["build_parser", "main"]

#: What a command raises for an argument it cannot use (a bad value, a module that is not there, a path it cannot
#: open), told in one line. Anything else is a fault, not a bad argument: its traceback is shown.
ARGUMENT_ERRORS = (ValueError, ImportError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def build_parser() -> argparse.ArgumentParser:
    """The ``mesh3d`` parser, every subcommand's arguments included (imports no torch).

    Usage: ``build_parser().parse_args(["plan", "m.py:f", "--input", "1x1x8x8"])``
    """
    parser = Parser(prog="mesh3d", description="3D-parallel training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"mesh3d {mesh3d.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mesh3d`` with ``argv`` (default: the process's); returns the exit status.

    Usage: ``main(["info"])``
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    problem = COMMANDS[args.command].check(args)
    if problem:
        parser.exit(2, f"mesh3d {args.command}: error: {problem} (see mesh3d {args.command} --help)\n")
    command = COMMANDS[args.command]
    if command.prepare is not None:  # e.g. the forkserver of mesh3d check's ranks, importing beside the command
        module, function = command.prepare.split(":")
        getattr(importlib.import_module(module), function)()
    module, function = command.run.split(":")
    run = getattr(importlib.import_module(module), function)
    try:
        return run(args)
    except ARGUMENT_ERRORS as err:
        print(f"mesh3d {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
