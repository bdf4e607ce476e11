"""Benchmark blocks against slabs: the same field, the same conv stack, the same number of domain ranks.

Usage::

    python scripts/bench_blocks.py                 # D=4: a 2x2 grid of blocks vs 4 slabs, ~1 minute on 2 cores
    python scripts/bench_blocks.py --size 256 --steps 3 --rounds 1 --out /tmp/blocks.json   # a smoke run

For each layout, per rank (the worst rank reported): halo bytes sent per step (forward and backward,
counted by ``domain.count_traffic``) against the geometric minimum (the input elements of other ranks
that this rank's 3x3 windows read, times the channels of each conv, both directions), the median step
time (forward+backward, ranks started together each step), and the activation bytes autograd saves.
Blocks run twice: as by default (no halo/compute overlap on blocks) and with it (``domain.window_overlap(True)``).
Writes docs/benchmarks/domain_blocks.json and domain_blocks.png; scripts/bench_report.py puts them in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cpu_model, median_step_time, plot_ratios  # noqa: E402
from bench_common import conv_stack  # noqa: E402
from bench_domain_scaling import SavedBytes  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def _outside_footprint(rows: tuple[int, int], cols: tuple[int, int], size: int) -> int:
    """Elements a 3x3 'same' window over this rank's rectangle reads from other ranks' rectangles."""
    (r0, r1), (c0, c1) = rows, cols
    if r1 == r0 or c1 == c0:
        return 0
    fr = min(r1 + 1, size) - max(r0 - 1, 0)
    fc = min(c1 + 1, size) - max(c0 - 1, 0)
    return fr * fc - (r1 - r0) * (c1 - c0)


def _rank(rank: int, world: int, port: int, layout: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.split import offsets_of

    blocks = layout.startswith("blocks")
    grid = (2, 2) if blocks else world
    dm = DistributedManager.initialize(batch=1, domain=grid)
    torch.manual_seed(0)
    model = conv_stack(args.channels, args.layers)
    x = torch.randn(args.batch, 1, args.size, args.size)
    whole = (0, args.size)
    if blocks:
        sizes = tuple(domain.balanced_sizes(args.size, 2) for _ in range(2))
        i, j = dm.axis_rank("domain_0"), dm.axis_rank("domain_1")
        rows = (offsets_of(sizes[0])[i], offsets_of(sizes[0])[i] + sizes[0][i])
        cols = (offsets_of(sizes[1])[j], offsets_of(sizes[1])[j] + sizes[1][j])

        def shard():
            return domain.shard(x, dims=(2, 3), sizes=sizes)
    else:
        slab = domain.balanced_sizes(args.size, world)
        k = dm.axis_rank("domain")
        rows, cols = (offsets_of(slab)[k], offsets_of(slab)[k] + slab[k]), whole

        def shard():
            return domain.shard(x, dim=2, sizes=slab)

    def step():
        with domain.window_overlap(True) if layout == "blocks_overlap" else contextlib.nullcontext():
            y = model(shard())
            (y * y).mean().backward()

    step()  # warm-up: plans are cached
    with domain.count_traffic() as traffic, SavedBytes() as saved:
        step_time = median_step_time(step, args.steps)
    # The minimum: each conv's input rows (forward) and the gradient of each conv input but x (backward).
    channels_in = [1] + [args.channels] * (args.layers - 1)
    elements = _outside_footprint(rows, cols, args.size) * args.batch
    minimum = elements * 4 * (sum(channels_in) + sum(channels_in[1:]))
    # the loss's global mean sends one 4-byte partial sum to each other rank per step: not a halo
    reduction = 4 * (world - 1)
    queue.put((rank, {"time_s": step_time, "bytes_sent": traffic.bytes_sent / args.steps - reduction,
                      "min_halo_bytes": minimum, "saved_bytes": saved.total / args.steps}))
    DistributedManager.shutdown()


def _run(layout: str, world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, layout, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = [r for _, r in sorted(queue.get(timeout=600) for _ in procs)]
    for p in procs:
        p.join()
    out = {"step_time_s": max(r["time_s"] for r in per_rank),
           "max_rank_bytes": max(r["bytes_sent"] for r in per_rank),
           "max_rank_min_halo_bytes": max(r["min_halo_bytes"] for r in per_rank),
           "total_bytes": sum(r["bytes_sent"] for r in per_rank),
           "total_min_halo_bytes": sum(r["min_halo_bytes"] for r in per_rank),
           "max_rank_activation_bytes": max(r["saved_bytes"] for r in per_rank)}
    out["bytes_vs_min"] = out["total_bytes"] / out["total_min_halo_bytes"]
    print(f"  {layout:12s}: {out['step_time_s'] * 1e3:7.1f} ms/step, halo bytes per rank (worst) "
          f"{out['max_rank_bytes'] / 1e3:8.1f} kB = {out['bytes_vs_min']:.3f} x the minimum, activation per rank "
          f"{out['max_rank_activation_bytes'] / 1e6:.1f} MB", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each layout; the best is kept")
    parser.add_argument("--out", type=Path, default=OUT / "domain_blocks.json",
                        help="the JSON report (the plot is written next to it)")
    args = parser.parse_args()
    world = 4
    print(f"== D={world}: 2x2 blocks vs {world}x1 slabs, {args.layers}-conv stack, {args.batch}x1x{args.size}x"
          f"{args.size}, one thread per rank on {os.cpu_count()} cores", flush=True)
    runs: dict[str, list[dict]] = {"slabs": [], "blocks": [], "blocks_overlap": []}
    for _ in range(args.rounds):
        for layout in runs:
            runs[layout].append(_run(layout, world, args))
    best = {layout: min(rs, key=lambda r: r["step_time_s"]) for layout, rs in runs.items()}
    ratios = {"step_time": best["blocks"]["step_time_s"] / best["slabs"]["step_time_s"],
              "halo_bytes_per_rank": best["blocks"]["max_rank_bytes"] / best["slabs"]["max_rank_bytes"],
              "activation_per_rank": best["blocks"]["max_rank_activation_bytes"] / best["slabs"]["max_rank_activation_bytes"]}
    overlap = {"step_time": best["blocks_overlap"]["step_time_s"] / best["blocks"]["step_time_s"],
               "halo_bytes_per_rank": best["blocks_overlap"]["max_rank_bytes"] / best["blocks"]["max_rank_bytes"]}
    print("  blocks / slabs: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
    print("  blocks with overlap / without: " + ", ".join(f"{k} {v:.3f}" for k, v in overlap.items()), flush=True)
    report = {"config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "domain": world,
                         "torch": torch.__version__, "cpu_count": os.cpu_count(), "cpu": cpu_model()},
              "slabs": best["slabs"], "blocks": best["blocks"], "blocks_overlap": best["blocks_overlap"],
              "blocks_vs_slabs": ratios, "overlap_vs_default": overlap}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot_ratios(args.out.with_suffix(".png"), ratios["step_time"], ratios["activation_per_rank"],
                ylabel="2x2 blocks / 4 slabs", goal=1.0)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
