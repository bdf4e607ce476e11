#!/usr/bin/env python
"""Bytes a Swin stage sends per rank on 2x2 lat x lon blocks against 4 latitude slabs (issue 67).

On blocks a window partition splits both block dims, so the field moves to slabs for the windows and back at the
shortcut (``docs/domain.md``, "Windows and patches on blocks"); sharded as slabs it moves only rows to whole windows
where a rank's rows cut one. This counts each rank's bytes sent in one forward and backward of two Swin blocks
(the second shifted) with ``domain.count_traffic``, checks the output against one process, and prints the ratio.

Usage::

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 scripts/bench_block_windows.py
    ... scripts/bench_block_windows.py --size 64 --dim 32 --window 8      # the defaults
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mesh3d import DistributedManager, domain  # noqa: E402
from test_domain_window_attention import SwinBlock  # noqa: E402  (the hand-written Swin block of the zoo)


def _stage(size: int, dim: int, window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(SwinBlock((size, size), dim=dim, heads=2, window=window),
                               SwinBlock((size, size), dim=dim, heads=2, window=window, shift=window // 2))


def _sent(net: torch.nn.Module, xs: torch.Tensor) -> tuple[int, torch.Tensor]:
    with domain.count_traffic() as traffic:
        y = net(xs)
        y.sum().backward()
    return traffic.bytes_sent, y.full_tensor().to_local()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--window", type=int, default=8)
    args = parser.parse_args()
    dm = DistributedManager.initialize(batch=1, domain=(2, 2))
    x = torch.randn(1, args.size, args.size, args.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _stage(args.size, args.dim, args.window)(x)
    on_blocks, y_blocks = _sent(_stage(args.size, args.dim, args.window), domain.shard(x, dims=(1, 2)))
    on_slabs, y_slabs = _sent(_stage(args.size, args.dim, args.window),
                              domain.redistribute(domain.shard(x, dims=(1, 2)), dim=1))
    sent = torch.tensor([on_blocks, on_slabs], dtype=torch.float64)
    busiest = sent.clone()
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    equal = bool(torch.allclose(y_blocks, want, rtol=1e-10) and torch.allclose(y_slabs, want, rtol=1e-10))
    if dm.rank == 0:
        mib = 1 / 2**20
        print(f"two Swin blocks on (1, {args.size}, {args.size}, {args.dim}) fp64, windows of {args.window}, forward + "
              f"backward, 4 ranks; outputs equal one process: {equal}")
        print(f"busiest rank sent: 2x2 blocks {busiest[0] * mib:.2f} MiB, 4 latitude slabs {busiest[1] * mib:.2f} MiB, "
              f"ratio {float(busiest[0] / busiest[1]):.1f}x")
    DistributedManager.shutdown()
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
