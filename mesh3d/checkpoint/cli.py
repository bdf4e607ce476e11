"""``mesh3d ckpt inspect|verify|coalesce``: checkpoint tools that need no torch.distributed (their arguments:
``mesh3d.commands``).

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

__all__ = ["run"]


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
                    print(f"mesh3d ckpt: error: --dtype {args.dtype!r} is not one of {sorted(DTYPES)}", file=sys.stderr)
                    return 2
                dtype = DTYPES[key]
            files = coalesce(args.path, args.out, dtype=dtype, max_shard_bytes=int(args.max_shard_gb * 1024**3),
                             progress=True)
            print(f"wrote {', '.join(files)} to {args.out}")
    except CheckpointError as err:
        print(f"mesh3d ckpt: error: {err}", file=sys.stderr)
        return 1
    return 0
