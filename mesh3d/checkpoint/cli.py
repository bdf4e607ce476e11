"""``mesh3d ckpt inspect|verify|coalesce``: checkpoint tools that need no torch.distributed.

Usage::

    mesh3d ckpt inspect ckpt/step-100
    mesh3d ckpt verify ckpt/step-100
    mesh3d ckpt coalesce ckpt/step-100 export/hf [--dtype bf16] [--max-shard-gb 5]
"""

from __future__ import annotations

import argparse
import sys
from mesh3d.checkpoint.coalesce import coalesce
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.inspect import describe, verify
from mesh3d.checkpoint.st_format import DTYPES

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    try:
        if args.ckpt_command == "inspect":
            print(describe(args.path))
        elif args.ckpt_command == "verify":
            report = verify(args.path, progress=True)
            print(f"OK: {report['tensors']} tensors in {report['files']} files, "
                  f"{report['bytes_verified'] / 1e6:.2f} MB checksummed, every element present exactly once")
        else:
            dtype = None
            if args.dtype is not None:
                key = args.dtype.upper()
                if key not in DTYPES:
                    print(f"error: --dtype {args.dtype!r} is not one of {sorted(DTYPES)}", file=sys.stderr)
                    return 2
                dtype = DTYPES[key]
            files = coalesce(args.path, args.out, dtype=dtype, max_shard_bytes=int(args.max_shard_gb * 1024**3),
                             progress=True)
            print(f"wrote {', '.join(files)} to {args.out}")
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
